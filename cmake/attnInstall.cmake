# Install rules: headers, the exported attn::attn, attn::native and attn::openmp targets,
# attnConfig.cmake and its version file. attn::native needs nothing more than attn::attn (its flag
# is a generator expression evaluated for the consumer's compiler), so it shares attnTargets.cmake
# and is always there. attn::openmp has an export file of its own, which attnConfig.cmake loads
# (and finds OpenMP for) only when the consumer asks for the openmp component; so has
# attn::distributed (MPI), installed when this build found MPI.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# A header-only package is architecture independent: its CMake files go under datadir.
set(ATTN_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/attn" CACHE STRING
    "Where attnConfig.cmake is installed, relative to the prefix")

install(TARGETS attn attn_native EXPORT attnTargets)
install(TARGETS attn_openmp EXPORT attnOpenMPTargets)
install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/attn" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(EXPORT attnTargets NAMESPACE attn:: DESTINATION "${ATTN_INSTALL_CMAKEDIR}")
install(EXPORT attnOpenMPTargets NAMESPACE attn:: DESTINATION "${ATTN_INSTALL_CMAKEDIR}")
# attn::distributed (MPI), when this build found MPI: an export file of its own, loaded by
# attnConfig.cmake (which finds MPI for it) when the consumer asks for the distributed component.
if(TARGET attn_distributed)
  install(TARGETS attn_distributed EXPORT attnDistributedTargets)
  install(EXPORT attnDistributedTargets NAMESPACE attn:: DESTINATION "${ATTN_INSTALL_CMAKEDIR}")
endif()

configure_package_config_file(
  "${PROJECT_SOURCE_DIR}/cmake/attnConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/attnConfig.cmake"
  INSTALL_DESTINATION "${ATTN_INSTALL_CMAKEDIR}")
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/attnConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion
  ARCH_INDEPENDENT)
install(FILES "${PROJECT_BINARY_DIR}/attnConfig.cmake"
              "${PROJECT_BINARY_DIR}/attnConfigVersion.cmake"
        DESTINATION "${ATTN_INSTALL_CMAKEDIR}")
install(FILES "${PROJECT_SOURCE_DIR}/LICENSE" DESTINATION "${CMAKE_INSTALL_DATADIR}/doc/attn")

# The build tree as a package too: find_package(attn) with attn_DIR (or CMAKE_PREFIX_PATH) set to
# this build folder finds the same targets, the headers taken from the source tree.
export(EXPORT attnTargets NAMESPACE attn:: FILE "${PROJECT_BINARY_DIR}/attnTargets.cmake")
export(EXPORT attnOpenMPTargets NAMESPACE attn:: FILE "${PROJECT_BINARY_DIR}/attnOpenMPTargets.cmake")
if(TARGET attn_distributed)
  export(EXPORT attnDistributedTargets NAMESPACE attn::
         FILE "${PROJECT_BINARY_DIR}/attnDistributedTargets.cmake")
endif()

# pkg-config (`pkg-config --cflags attn`): the include folder and Eigen's, relative to the .pc
# file's own place so that the installed tree can be moved. Threads and -march are the user's own
# flags there (-fopenmp, -march=native), as attn::openmp and attn::native add them.
set(ATTN_INSTALL_PKGCONFIGDIR "${CMAKE_INSTALL_DATADIR}/pkgconfig" CACHE STRING
    "Where attn.pc is installed, relative to the prefix")
file(RELATIVE_PATH ATTN_PC_TO_PREFIX "/prefix/${ATTN_INSTALL_PKGCONFIGDIR}" "/prefix")
file(RELATIVE_PATH ATTN_PC_INCLUDEDIR "/prefix" "/prefix/${CMAKE_INSTALL_INCLUDEDIR}")
configure_file("${PROJECT_SOURCE_DIR}/cmake/attn.pc.in" "${PROJECT_BINARY_DIR}/attn.pc" @ONLY)
install(FILES "${PROJECT_BINARY_DIR}/attn.pc" DESTINATION "${ATTN_INSTALL_PKGCONFIGDIR}")
