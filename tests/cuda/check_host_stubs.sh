#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# Fails when host code of an nvcc-built executable calls exit(). nvcc gives the host side of a
# __device__ function a body that calls exit(1), and it does not reject a call to one from a host
# function template: such a call compiles, and the program stops without a word on a device. The
# library and its tests never call exit() themselves, so every caller found is such a call.
#   check_host_stubs.sh OBJDUMP EXECUTABLE...
set -u
objdump=$1; shift
command -v "$objdump" >/dev/null 2>&1 || { echo "objdump not found: host stub check skipped"; exit 77; }
status=0
for exe in "$@"; do
  callers=$("$objdump" -d --no-show-raw-insn -C "$exe" | awk '/^[0-9a-f]+ <.*>:$/ { fn = $0 } /call.*<exit@plt>/ { print fn }' | sort -u)
  if [ -n "$callers" ]; then
    printf '%s: host code calls exit(), through a __device__ function called from the host:\n%s\n' "$exe" "$callers"
    status=1
  fi
done
[ $status -eq 0 ] && echo "$# executables: no host function calls exit()"
exit $status
