# Mixdesk: two commands for a fresh machine.
#   make run    set up .venv, fetch the default model, open the desktop window
#   make test   set up .venv with dev tools, run the whole test suite
PY      ?= python3
VENV    := .venv
PYBIN   := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
DEVSTAMP:= $(VENV)/.installed-dev

.PHONY: run test serve bench package model clean

$(STAMP): requirements.txt
	test -x $(PYBIN) || $(PY) -m venv $(VENV)
	$(PYBIN) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

$(DEVSTAMP): $(STAMP) requirements-dev.txt
	$(PYBIN) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $@

model: $(STAMP)
	$(PYBIN) -m core.default_model

run: model
	$(PYBIN) main.py $(ARGS)

serve: model
	$(PYBIN) main.py --headless $(ARGS)

test: $(DEVSTAMP) model
	QT_QPA_PLATFORM=offscreen $(PYBIN) -m pytest $(PYTEST_ARGS)

bench: model
	$(PYBIN) bench/engine.py

clean:
	rm -rf $(VENV) build dist
