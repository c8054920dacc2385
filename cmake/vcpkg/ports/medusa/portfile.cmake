# SPDX-License-Identifier: Apache-2.0
# Overlay port: builds medusa from the source tree this port lives in (../../../..), using the
# project's own install rules (the same ones the package consumption tests exercise).
set(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../../../..")

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    -DMEDUSA_BUILD_TESTS=OFF
    -DMEDUSA_BUILD_EXAMPLES=OFF
    -DMEDUSA_BUILD_BENCH=OFF
    -DMEDUSA_BUILD_CUDA=OFF
)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(PACKAGE_NAME medusa CONFIG_PATH share/cmake/medusa)

# Header-only: nothing architecture-specific is installed.
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug")
file(INSTALL "${SOURCE_PATH}/LICENSE" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}" RENAME copyright)
file(WRITE "${CURRENT_PACKAGES_DIR}/share/${PORT}/usage"
  "medusa provides CMake targets:\n\n  find_package(medusa CONFIG REQUIRED)\n  target_link_libraries(main PRIVATE medusa::medusa)\n\nmedusa::cuda (CCCL and cudart) is defined when the CUDA toolkit is found; the CUDA layer\nholds error checks and device queries so far.\n")
set(VCPKG_POLICY_EMPTY_INCLUDE_FOLDER disabled)
