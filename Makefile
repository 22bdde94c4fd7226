# oxygen_ros developer entry points. Every target sets up what it needs (scripts/setup_env.sh
# is idempotent and quick when nothing changed).
#   make demo    the main job: oxygen_node + simulated robot for DEMO_DURATION s of actions
#                (DEMO_DURATION=0 runs until Ctrl-C)
#   make test    the test suite
#   make lint    flake8 (ament configuration) + pep257
#   make colcon-check   colcon build of this repository in a temporary workspace
#   make clean   build outputs and the messages installed into .venv; make distclean: + .venv

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
DEMO_DURATION ?= 60

# Every process that opens DDS: discovery stays on this machine (otherwise Fast DDS multicasts
# out of the network interface) and each `make` run gets its own domain, so parallel runs and
# other ROS users do not see each other. OXYGEN_ROS_DOMAIN_ID=N picks one explicitly.
export ROS_AUTOMATIC_DISCOVERY_RANGE := LOCALHOST
export ROS_STATIC_PEERS :=
export ROS_DOMAIN_ID := $(or $(OXYGEN_ROS_DOMAIN_ID),$(shell echo $$(( 1 + $$$$ % 100 ))))
# ament_index finds share/oxygen_ros (launch, config) in the venv prefix. Python processes of
# the venv get this from oxygen_ros_dev.pth as well; this covers everything else.
export AMENT_PREFIX_PATH := $(VENV)$(if $(AMENT_PREFIX_PATH),:$(AMENT_PREFIX_PATH))

.PHONY: venv setup openpi-client-venv test lint demo colcon-check clean distclean

venv setup:
	bash scripts/setup_env.sh

# openpi's unmodified robot client for the server's wire-format tests (it pins numpy<2)
openpi-client-venv:
	bash scripts/setup_openpi_client_venv.sh

test: setup openpi-client-venv
	@echo "ROS_DOMAIN_ID=$(ROS_DOMAIN_ID) ROS_AUTOMATIC_DISCOVERY_RANGE=$(ROS_AUTOMATIC_DISCOVERY_RANGE)"
	rc=0; $(PY) -m pytest -q test/ || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; fi; \
	exit $$rc

lint: setup
	$(PY) -m flake8 --config setup.cfg oxygen_ros launch test setup.py
	$(PY) -m pydocstyle --config setup.cfg oxygen_ros

demo: setup
	$(PY) -m oxygen_ros.tools.demo --duration $(DEMO_DURATION)

colcon-check: setup
	bash scripts/colcon_check.sh

clean:
	@# the cmake install went into the venv prefix: remove exactly what it installed
	if [ -f build/cmake/install_manifest.txt ]; then \
	  xargs -d '\n' rm -f < build/cmake/install_manifest.txt; fi
	rm -rf build install log bench-results
	rm -rf $(VENV)/lib/oxygen_ros_msgs_python $(VENV)/share/oxygen_ros $(VENV)/lib/oxygen_ros
	rm -f $(VENV)/.oxygen_ros_msgs.sha256 \
	  $(VENV)/lib/python3.11/site-packages/oxygen_ros_dev.pth \
	  $(VENV)/bin/oxygen_node $(VENV)/bin/oxygen-ros $(VENV)/bin/chunk_player
	find oxygen_ros test -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(CURDIR)/.venv-openpi-client
