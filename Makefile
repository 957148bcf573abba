# SPDX-License-Identifier: Apache-2.0
# Shortcuts; the build itself is CMake's (build/).
.PHONY: demo build test
# The parameter-server demo: builds what is missing, runs it (RDMA natively
# when the host has a device, else in the Soft-RoCE VM), prints the tables.
# PYTHON=1: the Python trainer and ranker examples run beside the C clients.
demo:
	scripts/demo $(if $(PYTHON),--python)
build:
	cmake -S . -B build && cmake --build build -j
test:
	scripts/test
