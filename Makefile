# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

CHROMIUM := /usr/bin/chromium

.PHONY: demo test test-fast lint format bench clean browser natlab

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned: pip takes this CPU build from local disk; a looser spec fetches CUDA.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,lightning,coordinator]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/swarmgrad demo

# The browser tests drive Debian's chromium through playwright; nothing is downloaded at run time.
browser:
	@if [ -x $(CHROMIUM) ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's chromium for the browser tests"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
		|| { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }; \
	else \
		echo "the browser tests need Debian's chromium at $(CHROMIUM): run 'sudo apt-get install chromium'" >&2; exit 1; \
	fi

# The NAT lab's home routers are nftables rulesets (Debian's nftables) and a UPnP/NAT-PMP router
# (Debian's miniupnpd, nftables backend); the lab itself needs root, as the network lab does.
natlab:
	@if command -v nft >/dev/null && command -v miniupnpd >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's nftables and miniupnpd for the NAT lab"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q nftables miniupnpd-nftables >/dev/null \
		|| { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nftables miniupnpd-nftables >/dev/null; }; \
	else \
		echo "the NAT lab tests need root and Debian's nftables and miniupnpd: run 'sudo apt-get install nftables miniupnpd-nftables' and the tests as root" >&2; \
	fi

# Two passes. First every test on three workers (on two cores: the multi-process scenarios
# mostly wait on their peers' rounds, and the third worker takes that time): each module of
# scenarios (marked slow) is one xdist group, run in turn on one worker, the groups first and
# the quick tests filling the workers after them (tests/conftest.py). Then the few that time something
# against a reference (marked alone), by themselves.
test: $(STAMP) browser natlab
	@most=0; $(BIN)/python -m pytest -m "not alone" -n 3 --dist loadgroup || most=$$?; \
	alone=0; $(BIN)/python -m pytest -m alone || alone=$$?; \
	[ $$most -eq 0 ] && [ $$alone -eq 0 ]

test-fast: $(STAMP) browser natlab
	$(BIN)/python -m pytest -m "not slow" -n 2

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy peer server swarmgrad swarmlab

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(BIN)/python bench/gossip.py
	$(BIN)/python bench/gossip.py --sim 500

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
