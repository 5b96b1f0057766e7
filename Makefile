# xidstream: two commands on a fresh machine (Python 3.11+, Java 17 and Maven on PATH; for
# `make test` also Go 1.24+ and, as root, apt-get for Debian's etcd-server):
#   make demo   set everything up, start the local Kafka, replay the motivating incident
#   make test   set everything up and run every test, the real broker and API server included
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
XS     := $(BIN)/xidstream
# the checkout's workshop (workshop/: local broker, API server, node, e2e; not in the wheel)
WS     := $(BIN)/python -m workshop

.PHONY: demo demo-cluster test test-all test-cluster bench-failover e2e venv jars kube helm promtool chromium image kube-start kube-stop broker-start broker-stop schemas clean bench mutate

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

jars: venv
	$(WS) broker fetch

# kube-apiserver built from source once into ~/.cache/xidstream (Go 1.24+; about 5 min on 2
# cores, then nothing), etcd from Debian's etcd-server when missing. Tests taking `kube` start both.
kube: venv
	$(WS) kube fetch

# Helm (for the chart's tests) is no Debian package: built once from its Go module into
# ~/.cache/xidstream (about 2 min on 2 cores; a cold Go module cache downloads from the proxy),
# unless a helm is already on the PATH.
HELM_VERSION := v3.16.4
HELM_DIR     := $(HOME)/.cache/xidstream/helm-$(HELM_VERSION)
helm:
	@if [ -x $(HELM_DIR)/helm ]; then :; \
	elif command -v helm >/dev/null 2>&1; then echo "using $$(command -v helm)"; \
	else echo "building helm $(HELM_VERSION) into $(HELM_DIR) (once)"; \
	     GOBIN=$(HELM_DIR) go install helm.sh/helm/v3/cmd/helm@$(HELM_VERSION); fi

# promtool (the alert rules' check and unit tests) from Debian's prometheus package, unpacked into
# ~/.cache/xidstream without installing it (installing would start a Prometheus server on 0.0.0.0),
# unless a promtool is already on the PATH.
PROM_DIR := $(HOME)/.cache/xidstream/prometheus-deb
promtool:
	@if [ -x $(PROM_DIR)/promtool ]; then :; \
	elif command -v promtool >/dev/null 2>&1; then echo "using $$(command -v promtool)"; \
	else echo "unpacking promtool from Debian's prometheus package into $(PROM_DIR) (once)"; \
	     t=$$(mktemp -d) && (cd $$t && apt-get download prometheus >/dev/null 2>&1 && dpkg-deb -x prometheus_*.deb x) \
	     && mkdir -p $(PROM_DIR) && cp $$t/x/usr/bin/promtool $(PROM_DIR)/promtool; rc=$$?; rm -rf $$t; \
	     [ $$rc -eq 0 ] || { echo "make promtool: apt-get download prometheus failed (Debian 12 apt sources needed)" >&2; exit 1; }; fi

# Debian's chromium, for the test that screenshots an incident's HTML report (headless). Installed
# with apt-get as root when missing; otherwise named with the command that installs it.
chromium:
	@if command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then echo "installing Debian's chromium (once)"; \
	     DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null; \
	else echo "make chromium: run as root: apt-get install --no-install-recommends chromium" >&2; exit 1; fi

# One image per role (Containerfile's stages: node, processor, cluster-executor, exporter), from one
# build of the wheels (--layers keeps the shared stage), with buildah or podman: each is named
# $(IMAGE_REGISTRY)/xidstream-ROLE:$(IMAGE_TAG), as the Helm chart's values name them (image.registry,
# image.repositories, image.tag). BASE= another Debian 12 base with python3 and pip (`python -m
# workshop node image` builds on a debootstrap one); ROLES= a subset.
IMAGE_REGISTRY ?= ghcr.io/xidstream
IMAGE_TAG    ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
ROLES        ?= node processor cluster-executor exporter
BASE_ARG := $(if $(BASE),--build-arg BASE=$(BASE),)
image:
	@if command -v buildah >/dev/null 2>&1; then builder="buildah build"; \
	elif command -v podman >/dev/null 2>&1; then builder="podman build"; \
	else echo "make image: neither buildah nor podman is installed (e.g. apt-get install buildah); no image built" >&2; exit 1; fi; \
	for role in $(ROLES); do \
	  $$builder --layers $(BASE_ARG) --target $$role -f Containerfile -t $(IMAGE_REGISTRY)/xidstream-$$role:$(IMAGE_TAG) . || exit 1; \
	done

# Replays the motivating incident through collectors -> Kafka -> processor; starts and stops the
# local broker unless one is running.
demo: jars
	$(WS) replay scenarios/motivating-incident.yaml

# The closed loop: the motivating incident through collectors -> Kafka -> the signing processor ->
# both executors (--apply) on the local Kubernetes API server; prints the node's taints, the
# evictions and the results. Starts and stops the broker and the API server unless they run.
# Needs what `make kube` builds (Go 1.24+, etcd); `make demo` does not.
demo-cluster: jars kube
	$(WS) demo-cluster

# What a developer runs on every change (under 8 minutes on 2 cores): the fast tier, the API-server
# tests and one smoke test on the real broker per subsystem; Hypothesis's quick profile. The session
# starts the broker and the API server once (tests/conftest.py) and stops them.
test: jars kube helm promtool chromium
	XIDSTREAM_HYPOTHESIS=quick $(BIN)/pytest -q -m "not slow and not cluster"

# Every test (CI: .ci/run): also the `slow` ones (the whole-library replays, floods, the secure
# broker's paths) and the cluster tier, last, on its own three brokers; Hypothesis's thorough profile.
test-all: jars kube helm promtool chromium
	XIDSTREAM_HYPOTHESIS=thorough $(BIN)/pytest -q

# The cluster tier alone (tests/cluster/, marker `cluster`; `make test-all` runs it after everything
# else): a local KRaft cluster of three brokers (`python -m workshop broker start --brokers 3`,
# .xidstream/cluster/) started once for the run and stopped at the end; leaders SIGKILLed
# mid-incident, a rolling restart under a 1,000-GPU fleet, the secure cluster (about 6 minutes).
test-cluster: jars
	$(BIN)/pytest -q -m cluster tests/cluster

# Leader failover on that cluster: time to the first write and read after a SIGKILL, loss and
# duplicates, acks=all vs acks=1 on publish latency and on the worker's throughput
# (docs/operations.md). Not part of `make bench` (three JVMs).
bench-failover: jars
	$(BIN)/python bench/broker_failover.py

# The chart on a real single-node cluster (kubelet + containerd, root): the image built with buildah
# on a debootstrap base, `helm install`, an Xid 79 written to /dev/kmsg, the node cordoned and
# drained by the real kubelet (docs/operations.md "End to end on a real node"). Installs Debian's containerd,
# runc, buildah, debootstrap, CNI plugins and iptables with apt-get when missing; builds the node
# binary once (2-8 min). E2E_RUNS=10 repeats the Xid 79 and prints the median latencies.
E2E_RUNS ?= 1
e2e: jars kube helm
	$(WS) e2e --runs $(E2E_RUNS)

broker-start: jars
	$(WS) broker start

broker-stop: venv
	$(WS) broker stop

kube-start: kube
	$(WS) kube start

kube-stop: venv
	$(WS) kube stop

schemas: venv
	$(XS) schemas generate

# Benchmarks print figures (see docs/performance.md); they are not part of `make test`.
bench: jars
	$(BIN)/python bench/collector_bench.py
	$(BIN)/python bench/processor_bench.py
	$(BIN)/python bench/processor_scale.py

# Mutation testing of the rule modules (mutmut 3, in a staged copy under .xidstream/mutate/; not part of `make test`):
# the score per module and the surviving mutants (bench/mutation_report.py; reviewed equivalent
# mutants are listed in tests/mutation_equivalent.txt). One module, incrementally:
#   make mutate MODULES=schemas/signing.py MUTATE_TESTS="tests/schemas"
# MUTATE_TESTS: the tests that judge the mutants (the fast tier under them); MUTATE_JOBS: workers.
MODULES      ?= collectors/parse/ collectors/spool.py collectors/sink.py streams/evidence.py streams/verdict.py \
                streams/classify.py streams/incident.py streams/fleet.py streams/policy.py executors/gate.py \
                schemas/signing.py exporters/ocsf.py streams/handoff.py transport/identity.py
MUTATE_TESTS ?= tests
MUTATE_JOBS  ?= 1
mutate: venv
	$(BIN)/python bench/mutation_report.py --run --jobs $(MUTATE_JOBS) --tests "$(MUTATE_TESTS)" $(MODULES)

clean:
	-$(WS) broker stop
	-$(WS) kube stop
	rm -rf $(VENV) .xidstream .pytest_cache .hypothesis
