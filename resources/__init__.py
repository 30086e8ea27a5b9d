"""Mixdesk's data files (demo adapters, icons, the stylesheet), found at run time
through ``importlib.resources`` (see ui/util.py): a package so that an installed
wheel (``pipx install .``) and a checkout resolve it the same way."""
