# outbox-operator — build, test and run the transactional-outbox relay operator.
# Every tool and dependency used below is pinned here and provided under ./bin
# by this Makefile; nothing is assumed to be on the machine but Go, a JDK and
# Maven (and apt-get, to install PostgreSQL when it is absent).

SHELL := /usr/bin/env bash -o pipefail
.SHELLFLAGS := -ec
.DEFAULT_GOAL := help

## Versions (the README explains the pairing).
KUBE_VERSION ?= 1.37.2
ETCD_VERSION ?= 3.6.6
# The node beside the API server (make deps-node): kubelet, controller
# manager, scheduler and kube-proxy are KUBE_VERSION; containerd 2.x is what
# kubelets from 1.36 on need.
CONTAINERD_VERSION ?= 2.4.2
KAFKA_VERSION ?= 4.1.1
CONTROLLER_TOOLS_VERSION ?= v0.23.0
# promtool (github.com/prometheus/prometheus) runs the alert rules' unit tests.
PROMETHEUS_VERSION ?= v0.316.0

LOCALBIN := $(CURDIR)/bin
KUBE_ASSETS := $(LOCALBIN)/k8s/$(KUBE_VERSION)-etcd$(ETCD_VERSION)
NODE_ASSETS := $(LOCALBIN)/node/$(KUBE_VERSION)-containerd$(CONTAINERD_VERSION)
KAFKA_LIBS := $(LOCALBIN)/kafka/$(KAFKA_VERSION)/libs
PG_LINK := $(LOCALBIN)/postgresql/current
CONTROLLER_GEN := $(LOCALBIN)/tools/controller-gen-$(CONTROLLER_TOOLS_VERSION)/controller-gen
KUBECTL := $(KUBE_ASSETS)/kubectl
PROMTOOL := $(LOCALBIN)/tools/promtool-$(PROMETHEUS_VERSION)/promtool
CHART := charts/outbox-operator
# The image dist/install.yaml pins (make installer IMG=...): no default, as
# a release's image would run an older operator than this tree's CRD.
IMG ?=
DIST ?= $(CURDIR)/dist

# What tests and tools find the dependencies through (test/testenv).
export KUBEBUILDER_ASSETS := $(KUBE_ASSETS)
export OUTBOX_NODE_ASSETS := $(NODE_ASSETS)
export OUTBOX_KAFKA_LIBS := $(KAFKA_LIBS)
export OUTBOX_PG_BIN := $(PG_LINK)
export CONTROLLER_GEN
export PROMTOOL

GO_TEST_FLAGS ?= -count=1 -timeout 25m
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# APT_INSTALL is a recipe's shell step that installs the Debian packages
# the shell variable missing names, if any, after updating apt's lists (a
# fresh image has none).
APT_INSTALL = if [ -n "$$missing" ]; then \
		echo ">> installing Debian's$$missing"; \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -q; \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

##@ General

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*##"; printf "\nUsage:\n  make \033[36m<target>\033[0m\n"} /^[a-zA-Z_0-9-]+:.*?##/ { printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2 } /^##@/ { printf "\n\033[1m%s\033[0m\n", substr($$0, 5) } ' $(MAKEFILE_LIST)

.PHONY: demo
demo: demo-check deps ## Run the whole system on this machine (a one-node cluster with the operator, config/samples, order service, live view); Ctrl-C stops it.
	$(LOCALBIN)/demo -dir $(CURDIR)/.demo

.PHONY: demo-check
demo-check: ## Build the demo and refuse a machine its node cannot run on (not root, cgroup v2) before make deps builds anything.
	mkdir -p $(LOCALBIN)
	CGO_ENABLED=0 go build -o $(LOCALBIN)/demo ./cmd/demo
	$(LOCALBIN)/demo -check

.PHONY: demo-autoscaling
demo-autoscaling: demo-check deps ## make demo with the relay autoscaled on its backlog (0..4 replicas) and bursts of 20,000 rows: watch it scale up, drain and go back to zero.
	$(LOCALBIN)/demo -dir $(CURDIR)/.demo -autoscaling

##@ Development

.PHONY: fmt
fmt: ## Run gofmt on the code.
	gofmt -s -w $$(git ls-files '*.go')

# What builds on every platform a developer runs: the packages applications
# import and the two binaries (the demo and the test environment start Linux
# processes and stay Linux-only).
PORTABLE_PKGS = ./api/... ./outbox/... ./relay/... ./relayconfig/... ./dbauth/... ./kafkaauth/... ./version/... ./controllers/... ./examples/... ./cmd/manager ./cmd/relay

.PHONY: vet
vet: ## Run go vet and a gofmt check, and build the packages applications import and both binaries for macOS too.
	@unformatted="$$(gofmt -l $$(git ls-files '*.go'))"; if [ -n "$$unformatted" ]; then echo "not gofmt'ed (make fmt): $$unformatted"; exit 1; fi
	go vet ./...
	GOOS=darwin go build $(PORTABLE_PKGS)

.PHONY: generate
generate: $(CONTROLLER_GEN) ## Generate DeepCopy methods for the API types.
	$(CONTROLLER_GEN) object:headerFile="hack/boilerplate.go.txt" paths="./api/..."

.PHONY: manifests
manifests: $(CONTROLLER_GEN) ## Generate the CRD and RBAC manifests under config/.
	$(CONTROLLER_GEN) rbac:roleName=manager-role crd paths="./api/..." paths="./controllers/..." \
		output:crd:artifacts:config=config/crd/bases output:rbac:artifacts:config=config/rbac
	@$(MAKE) --no-print-directory chart-sync

.PHONY: test
test: deps vet ## Run every test against real PostgreSQL, Kafka and kube-apiserver (provisions them first).
	go test $(GO_TEST_FLAGS) ./...
	$(MAKE) --no-print-directory test-ops

.PHONY: test-ops
test-ops: deps $(PROMTOOL) ## Run the Helm chart, install bundle and monitoring tests (module test/ops: Helm and Prometheus stay out of go.mod).
	cd test/ops && go vet ./... && go test $(GO_TEST_FLAGS) ./...

.PHONY: test-upgrade
test-upgrade: deps $(PROMTOOL) ## Upgrade from the latest release tag to this tree on a real node, by install.yaml and by helm upgrade, with traffic through two OutboxRelays (~6 min; CI runs it after make test).
	cd test/ops && go test $(GO_TEST_FLAGS) -tags upgrade -run TestUpgradeFromPreviousRelease ./upgrade/

.PHONY: test-e2e
test-e2e: deps ## Run only the end-to-end test (a one-node cluster with the operator, PostgreSQL and Kafka).
	go test $(GO_TEST_FLAGS) ./test/e2e/...

##@ Build

.PHONY: build
build: ## Build the manager and relay binaries into bin/.
	CGO_ENABLED=0 go build -trimpath -o $(LOCALBIN)/manager ./cmd/manager
	CGO_ENABLED=0 go build -trimpath -o $(LOCALBIN)/relay ./cmd/relay

# Where `make images` writes its docker-archive tarballs.
IMAGES_DIR ?= $(LOCALBIN)/images

.PHONY: images
images: ## Build the operator image (as the Dockerfile does) and the pod sandbox image without Docker into bin/images/ (VERSION=v0.1.0 sets the tag).
	go run ./hack/images -out $(IMAGES_DIR) $(if $(VERSION),-version $(VERSION))

##@ Release

.PHONY: release
release: deps-kube ## Write release VERSION=x.y.z into dist/: the image for linux/amd64 and linux/arm64 (OCI index), its SBOM, the chart, install.yaml pinned by digest, checksums.txt (docs/release.md).
	@test -n "$(VERSION)" || { echo "make release VERSION=x.y.z (no leading v)"; exit 2; }
	go run ./hack/images -release $(VERSION) -out $(DIST) -kubectl $(KUBECTL)

.PHONY: bundle
bundle: deps-kube ## Write the OLM bundle of release VERSION=x.y.z into bundle/ (CSV, CRD, metadata/annotations.yaml); test/ops/bundle validates it with OperatorHub's checks.
	@test -n "$(VERSION)" || { echo "make bundle VERSION=x.y.z (no leading v)"; exit 2; }
	go run ./hack/bundle -version $(VERSION) -out bundle -kubectl $(KUBECTL)

.PHONY: chart-sync
chart-sync: ## Copy the CRD, the RBAC rules, the alerts and the dashboard from config/ into the Helm chart.
	cp config/crd/bases/*.yaml $(CHART)/files/crds/
	cp config/rbac/role.yaml config/rbac/leader_election_role.yaml config/rbac/digest_key_role.yaml config/rbac/metrics_auth_role.yaml config/rbac/metrics_reader_role.yaml \
		config/rbac/outboxrelay_editor_role.yaml config/rbac/outboxrelay_viewer_role.yaml config/prometheus/prometheusrule.yaml \
		config/grafana/outbox-operator-dashboard.json $(CHART)/files/

# RELAY_IMAGE is an env value, which kustomize's image setter leaves alone:
# one substitution pins the manager's image and the default relay image.
.PHONY: installer
installer: deps-kube ## Write dist/install.yaml: what `kubectl apply -k config/default` applies, with the image pinned to IMG (an image built from this tree).
	@test -n "$(IMG)" || { echo "make installer IMG=<an operator image built from this tree> (a release's install.yaml comes with the release: docs/release.md)"; exit 2; }
	mkdir -p $(DIST)
	$(KUBECTL) kustomize config/default | sed 's|ghcr.io/outbox-relay/outbox-operator:latest|$(IMG)|g' > $(DIST)/install.yaml
	@echo ">> wrote $(DIST)/install.yaml ($(IMG))"

##@ Benchmarks

BENCH_FLAGS ?=
BENCH_QUICK_FLAGS ?=

.PHONY: bench
bench: deps-postgres deps-kafka deps-kube deps-node ## Measure ceiling, drain, the naive claim shape, scaling, latency, retention, headers and tracing, a long-lived table, the backlog read, footprint and autoscaling; writes docs/benchmarks.md and bench/results.json.
	go run ./test/bench $(BENCH_FLAGS)

.PHONY: chaos
CHAOS_DURATION ?= 10m
CHAOS_CAPTURE ?=
CHAOS_REPORT ?= $(CURDIR)/docs/chaos-report.md
chaos: deps-postgres deps-kafka ## Run random fault scenarios for CHAOS_DURATION (default 10m), of one capture mode only with CHAOS_CAPTURE (as the report's capture column names it), and write CHAOS_REPORT (default docs/chaos-report.md).
	go test -count=1 -timeout 0 -run '^TestFaults$$' ./relay/ -args -chaos.duration $(CHAOS_DURATION) -chaos.capture "$(CHAOS_CAPTURE)" -chaos.report $(CHAOS_REPORT)

.PHONY: chaos-migrations
MIGRATION_HISTORIES ?= 100
chaos-migrations: deps-postgres deps-kafka ## Run MIGRATION_HISTORIES (default 100) random histories of table migrations under logical replication, with writer deletes and without, each of which must lose no event (TestLogicalReplicationLosesNothingThroughMigrations); a failing seed is named in the output.
	go test -count=1 -timeout 0 -run '^TestLogicalReplicationLosesNothingThroughMigrations$$' ./relay/ -args -migration.random $(MIGRATION_HISTORIES)

.PHONY: bench-quick
bench-quick: deps-postgres deps-kafka ## A short subset of `make bench` (writes bench/quick.md and bench/quick-results.json).
	go run ./test/bench -quick $(BENCH_QUICK_FLAGS)

.PHONY: bench-fleet
bench-fleet: deps-postgres deps-kube ## The operator with 1,000 OutboxRelays in 50 namespaces on one real database: time to Ready, RSS, CPU, connections, API and Secret requests (writes bench/fleet.md and bench/fleet-results.json).
	go run ./test/bench -scenarios operator-fleet -out-md bench/fleet.md -out-json bench/fleet-results.json $(BENCH_FLAGS)

.PHONY: bench-capture
bench-capture: deps-postgres deps-kafka ## Polling, polling with the wake-up and logical replication side by side in one run: latency at 1,000 and 5,000 events/s, relay CPU and claim transactions per 1k events, database CPU per 1k events, WAL per event, writers against no relay (on a shared machine, and with the relay and Kafka on a CPU of their own), the drain of a 100,000-row backlog, the Kafka hop alone as the floor under their latency, and each capture target met or missed (writes bench/capture.md and bench/capture-results.json).
	go run ./test/bench -scenarios capture-modes -latency-duration 20s -writers-duration 5s -rows 100000 -out-md bench/capture.md -out-json bench/capture-results.json $(BENCH_FLAGS)

.PHONY: bench-linger
bench-linger: deps-postgres deps-kafka ## Adaptive polling's wait after a partial claim, the default, 10 ms and 20 ms, against a relay polling every 200 ms at 1,000 events/s in five rounds: p50, p99, relay CPU and claim transactions per 1k events, ratios per round (writes bench/linger.md and bench/linger-results.json).
	go run ./test/bench -scenarios linger-cost -rates 1000 -reps 5 -latency-duration 20s -out-md bench/linger.md -out-json bench/linger-results.json $(BENCH_FLAGS)

.PHONY: bench-ordering
bench-ordering: deps-postgres deps-kafka ## Both orderings side by side: ceiling, drain at batch 50 and 500, 1, 2 and 4 replicas (writes bench/ordering.md and bench/ordering-results.json).
	go run ./test/bench -scenarios claim-ceiling,drain,replica-scaling -orderings none,partition-key -out-md bench/ordering.md -out-json bench/ordering-results.json $(BENCH_FLAGS)

.PHONY: bench-relay
bench-relay: deps-postgres deps-kafka ## The relay alone: ceiling, drain at batch 50 and 500, the naive claim shape (writes bench/relay.md and bench/relay-results.json).
	go run ./test/bench -scenarios claim-ceiling,drain,naive-per-row -orderings none -out-md bench/relay.md -out-json bench/relay-results.json $(BENCH_FLAGS)

##@ Dependencies

.PHONY: deps
deps: deps-postgres deps-kafka deps-kube deps-node $(CONTROLLER_GEN) ## Provide PostgreSQL, Kafka, kube-apiserver+etcd+kubectl, the node and controller-gen (idempotent, cached in bin/).

.PHONY: deps-postgres
deps-postgres: ## Link the machine's PostgreSQL server binaries into bin/ (apt-get installs them when absent).
	@missing=""; \
	ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || missing=" postgresql"; \
	$(APT_INSTALL)
	@pgbin=$$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1); \
	mkdir -p $(LOCALBIN)/postgresql; \
	ln -sfn "$$pgbin" $(PG_LINK); \
	echo ">> PostgreSQL: $$($$pgbin/postgres --version) ($(PG_LINK) -> $$pgbin)"

.PHONY: deps-kafka
deps-kafka: $(KAFKA_LIBS)/.complete ## Fetch the Kafka $(KAFKA_VERSION) broker jars through mvn (needs a JDK 17+).
$(KAFKA_LIBS)/.complete: hack/kafka/pom.xml
	@missing=""; \
	command -v java >/dev/null || missing="$$missing openjdk-17-jre-headless"; \
	command -v mvn >/dev/null || missing="$$missing maven"; \
	$(APT_INSTALL)
	@echo ">> fetching Kafka $(KAFKA_VERSION) jars from Maven Central"
	rm -rf $(KAFKA_LIBS)
	mvn -q -B -f hack/kafka/pom.xml dependency:copy-dependencies -Dkafka.version=$(KAFKA_VERSION) -DoutputDirectory=$(KAFKA_LIBS)
	touch $@

.PHONY: deps-kube
deps-kube: $(KUBE_ASSETS)/etcd ## Build kube-apiserver, kubectl $(KUBE_VERSION) and etcd $(ETCD_VERSION) from source (~5 min once).
$(KUBE_ASSETS)/etcd: hack/build-kube.sh hack/kube-module.sh
	hack/build-kube.sh $(KUBE_VERSION) $(ETCD_VERSION) $(KUBE_ASSETS)
	touch $@

.PHONY: deps-node
deps-node: $(NODE_ASSETS)/containerd ## Build kubelet, kube-controller-manager, kube-scheduler, kube-proxy $(KUBE_VERSION) and containerd $(CONTAINERD_VERSION) (~6 min once); install Debian's runc, CNI plugins and iptables.
	@missing=""; \
	command -v runc >/dev/null || missing="$$missing runc"; \
	[ -x /usr/lib/cni/bridge ] || missing="$$missing containernetworking-plugins"; \
	command -v iptables >/dev/null || missing="$$missing iptables"; \
	command -v ip >/dev/null || missing="$$missing iproute2"; \
	$(APT_INSTALL)
$(NODE_ASSETS)/containerd: hack/build-node.sh hack/kube-module.sh
	hack/build-node.sh $(KUBE_VERSION) $(CONTAINERD_VERSION) $(NODE_ASSETS)
	touch $@

$(CONTROLLER_GEN):
	GOBIN=$(dir $(CONTROLLER_GEN)) go install sigs.k8s.io/controller-tools/cmd/controller-gen@$(CONTROLLER_TOOLS_VERSION)

$(PROMTOOL):
	GOBIN=$(dir $(PROMTOOL)) go install github.com/prometheus/prometheus/cmd/promtool@$(PROMETHEUS_VERSION)

.PHONY: clean
clean: ## Remove built binaries (keeps the cached dependencies).
	rm -f $(LOCALBIN)/manager $(LOCALBIN)/relay
