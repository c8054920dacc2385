# SPDX-License-Identifier: Apache-2.0
"""Conan 2 recipe for medusa: a header-only package built on the project's CMake install rules."""
import os
import re

from conan import ConanFile
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout
from conan.tools.files import copy, load


class MedusaConan(ConanFile):
    name = "medusa"
    license = "Apache-2.0"
    description = ("Header-only C++20 Medusa speculative decoding: trees, heads, acceptance, "
                   "KV commit; CPU and CUDA.")
    topics = ("llm", "inference", "speculative-decoding", "header-only", "cuda")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    options = {"cuda": [True, False]}
    default_options = {"cuda": False}
    exports_sources = "CMakeLists.txt", "LICENSE", "include/*", "cmake/*"
    no_copy_source = True

    def set_version(self):
        config = load(self, os.path.join(self.recipe_folder, "include", "medusa", "config.hpp"))
        parts = [re.search(rf"#define MEDUSA_VERSION_{p} (\d+)", config).group(1)
                 for p in ("MAJOR", "MINOR", "PATCH")]
        self.version = ".".join(parts)

    def layout(self):
        cmake_layout(self)

    def generate(self):
        tc = CMakeToolchain(self)
        tc.cache_variables["MEDUSA_BUILD_TESTS"] = False
        tc.cache_variables["MEDUSA_BUILD_EXAMPLES"] = False
        tc.cache_variables["MEDUSA_BUILD_BENCH"] = False
        tc.cache_variables["MEDUSA_BUILD_CUDA"] = False
        tc.generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()

    def package(self):
        # The project's own install rules: headers, medusaConfig.cmake, targets, license.
        cmake = CMake(self)
        cmake.install()
        copy(self, "LICENSE", self.source_folder, os.path.join(self.package_folder, "licenses"))

    def package_id(self):
        self.info.clear()

    def package_info(self):
        # Consumers use the package's own medusaConfig.cmake (medusa::medusa, medusa::cuda).
        self.cpp_info.set_property("cmake_find_mode", "none")
        self.cpp_info.builddirs = [os.path.join("share", "cmake", "medusa")]
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        if self.options.cuda:
            self.cpp_info.system_libs = ["cudart"]
