# The .deb (cpack -G DEB, in the build folder): th-server, th-ctl, th-demo, th-plan, th-bench,
# timeline-plot, libthclient with its headers, CMake and pkg-config files, the Python package,
# and th-server's systemd unit. Installing it creates the system user tensorhub, a cluster token
# in /etc/tensorhub/token (0600, if there is none) and, where systemd runs, enables and starts
# th-server. tests/install/deb_test.sh builds, installs, starts and purges it.
include(GNUInstallDirs)
install(PROGRAMS ${PROJECT_SOURCE_DIR}/tools/timeline-plot DESTINATION ${CMAKE_INSTALL_BINDIR})

# The example unit names /usr/local/bin (a `cmake --install` default); the package installs in /usr.
file(READ ${PROJECT_SOURCE_DIR}/examples/systemd/th-server.service th_unit)
string(REPLACE "/usr/local/bin/" "/usr/bin/" th_unit "${th_unit}")
string(REPLACE "file:///usr/local/share/doc/tensorhub/README.md" "file:///usr/share/doc/tensorhub/README.md"
       th_unit "${th_unit}")
file(WRITE ${PROJECT_BINARY_DIR}/deb/th-server.service "${th_unit}")
install(FILES ${PROJECT_BINARY_DIR}/deb/th-server.service DESTINATION lib/systemd/system COMPONENT deb EXCLUDE_FROM_ALL)
install(FILES ${PROJECT_SOURCE_DIR}/README.md DESTINATION share/doc/tensorhub COMPONENT deb EXCLUDE_FROM_ALL)

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME tensorhub)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_CONTACT "TensorHub maintainers <tensorhub@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "weight transfer for LLM reinforcement learning: th-server, th-ctl, libthclient")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_STRIP_FILES ON)  # the build is RelWithDebInfo; the package carries no debug info
set(CPACK_DEBIAN_PACKAGE_SECTION net)
# The libraries' packages (libcapnp, libkj, libxxhash, OpenSSL) from what the binaries link.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# adduser: postinst. python3 3.11: timeline-plot, and the Python package (built for Debian 12's
# python3, in /usr/lib/python3.11/dist-packages).
set(CPACK_DEBIAN_PACKAGE_DEPENDS "adduser, python3 (>= 3.11), python3 (<< 3.12)")
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "python3-matplotlib, rdma-core")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${PROJECT_SOURCE_DIR}/tools/deb/postinst ${PROJECT_SOURCE_DIR}/tools/deb/prerm ${PROJECT_SOURCE_DIR}/tools/deb/postrm)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
# What `cmake --install` installs (component Unspecified), and the unit and the README (component
# deb, which only the package installs: the unit names /usr/bin) in one package.
set(CPACK_DEB_COMPONENT_INSTALL OFF)
set(CPACK_INSTALL_CMAKE_PROJECTS "${PROJECT_BINARY_DIR};${PROJECT_NAME};Unspecified;/"
                                 "${PROJECT_BINARY_DIR};${PROJECT_NAME};deb;/")
# dpkg-shlibdeps finds libthclient, which the package itself brings.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS ${PROJECT_BINARY_DIR}/client)
include(CPack)
