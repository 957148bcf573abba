# SPDX-License-Identifier: Apache-2.0
# Debian packages with CPack's DEB generator (cpack -G DEB in the build
# directory; tests/packaging checks them): libbex0 (the shared library),
# libbex-dev (headers, libbex.so, libbex.a, bex.pc, the CMake package) and
# bex-ps (bex-ps, bex-info, a systemd unit that stops it with SIGTERM, which
# it takes as a drain). Install components: libbex, dev, ps.
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME bex)
set(CPACK_PACKAGE_VENDOR "bex")
set(CPACK_PACKAGE_CONTACT "bex maintainers <bex@example.invalid>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "RDMA communication layer for parameter-server ML")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_RESOURCE_FILE_LICENSE ${PROJECT_SOURCE_DIR}/LICENSE)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL libbex dev ps)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION libs)
# dependencies of the shared objects from dpkg-shlibdeps; libbex.so.0 of
# this build is the packages' own (private here, named by hand below)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS ${PROJECT_BINARY_DIR})
set(bex_deb_same "(= ${PROJECT_VERSION})")

set(CPACK_DEBIAN_LIBBEX_PACKAGE_NAME libbex${PROJECT_VERSION_MAJOR})
set(CPACK_COMPONENT_LIBBEX_DESCRIPTION
    "bex: RDMA communication layer for parameter-server ML (shared library)\n"
    "Sockets over RDMA and TCP, RPC, a service directory and a parameter server client.")

set(CPACK_DEBIAN_DEV_PACKAGE_NAME libbex-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS
    "libbex${PROJECT_VERSION_MAJOR} ${bex_deb_same}, libibverbs-dev, libsodium-dev, libjansson-dev, libcurl4-openssl-dev")
set(CPACK_COMPONENT_DEV_DESCRIPTION
    "bex: development files\nHeaders, libbex.so, libbex.a, bex.pc and the CMake package (find_package(bex)).")

set(CPACK_DEBIAN_PS_PACKAGE_NAME bex-ps)
set(CPACK_DEBIAN_PS_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PS_PACKAGE_DEPENDS "libbex${PROJECT_VERSION_MAJOR} ${bex_deb_same}")
set(CPACK_COMPONENT_PS_DESCRIPTION
    "bex: the parameter server and bex-info\nbex-ps with a systemd unit (bex-ps.service) that drains it on SIGTERM, and bex-info, which shows what bex would use on a host and checks the path to a peer.")
include(CPack)
