# Two commands matter: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install bench browser clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c requirements.lock -e '.[dev,orchestration]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/strag demo

# Headless Chromium for the report tests (Debian's package; needs root or sudo).
browser:
	@command -v chromium >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

test: $(STAMP) browser
	$(BIN)/python -m pytest -n 2 -q tests

bench: $(STAMP)
	for f in benchmarks/bench_*.py; do $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) demo-lake demo-out bench-out
