# xidstream: two commands on a fresh machine (Python 3.11+, Java 17 and Maven on PATH):
#   make demo   set everything up, start the local Kafka, replay the motivating incident
#   make test   set everything up and run every test, the real broker included
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
XS     := $(BIN)/xidstream

.PHONY: demo test venv jars broker-start broker-stop schemas clean bench

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

jars: venv
	$(XS) broker fetch

# Replays the motivating incident through collectors -> Kafka -> processor; starts and stops the
# local broker unless one is running.
demo: jars
	$(XS) replay scenarios/motivating-incident.yaml

# The test session starts the broker once (tests/conftest.py) and stops it at the end.
test: jars
	$(BIN)/pytest -q

broker-start: jars
	$(XS) broker start

broker-stop: venv
	$(XS) broker stop

schemas: venv
	$(XS) schemas generate

# Benchmarks print figures (see README "Performance"); they are not part of `make test`.
bench: jars
	$(BIN)/python bench/collector_bench.py
	$(BIN)/python bench/processor_bench.py

clean:
	-$(XS) broker stop
	rm -rf $(VENV) .xidstream .pytest_cache .hypothesis
