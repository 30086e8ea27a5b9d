# Mixdesk: two commands for a fresh machine.
#   make run    set up .venv, fetch the default model, open the desktop window
#   make test   set up .venv with dev tools, run the whole test suite
PY      ?= python3
VENV    := .venv
PYBIN   := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
DEVSTAMP:= $(VENV)/.installed-dev

.PHONY: run test lint serve bench package model clean compat interop

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

lint: $(DEVSTAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint model
	QT_QPA_PLATFORM=offscreen $(PYBIN) -m pytest $(PYTEST_ARGS)

bench: model
	$(PYBIN) -m bench.engine $(ARGS)

# make compat: llama.cpp's own server tests (from the pinned llama-cpp-python sdist)
# against main.py --headless, through our adapter (tools/compat.py); prints a per-file
# passed/failed table. Not part of make test: the full run takes ~25 minutes.
# COMPAT_ARGS="--files test_basic.py test_completion.py" runs a subset, "--all" every file;
# "--llama-server-bin PATH --record docs/compat-results.json" records both servers' run,
# from which tools/compat_docs.py writes docs/compatibility.md. Works in the user cache dir.
compat: model
	$(PYBIN) tools/compat.py $(COMPAT_ARGS)

# make interop: three mixes exported from Mixdesk (linear, ties, a negative scale) give
# llama-server's greedy tokens (--lora and merged, float32 SmolLM2, f32 KV cache) and
# PEFT's logits (within 1e-3) (tools/interop.py). Not part of make test: llama-server is
# built once from the pinned sdist (~25 min), or INTEROP_ARGS="--llama-server-bin PATH".
interop: model $(DEVSTAMP)
	$(PYBIN) tools/interop.py $(INTEROP_ARGS)

clean:
	rm -rf $(VENV) build dist

# make package: a one-folder app in dist/mixdesk/ (PyInstaller, packaging/mixdesk.spec),
# built in its own venv (build/pkgvenv), then smoke-tested: headless /health + a
# completion, and the window offscreen with the demo adapters (packaging/smoke.py).
PKGVENV  := build/pkgvenv
PKGSTAMP := $(PKGVENV)/.installed

$(PKGSTAMP): requirements.txt requirements-package.txt
	test -x $(PKGVENV)/bin/python || $(PY) -m venv $(PKGVENV)
	$(PKGVENV)/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-package.txt
	touch $@

package: $(PKGSTAMP) model
	$(PKGVENV)/bin/python -m PyInstaller --noconfirm --log-level WARN \
		--distpath dist --workpath build/pyinstaller packaging/mixdesk.spec
	$(PYBIN) packaging/smoke.py dist/mixdesk/mixdesk
	@du -sh dist/mixdesk
