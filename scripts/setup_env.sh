#!/usr/bin/env bash
# Create or update the dev environment of oxygen_ros in ./.venv. Idempotent: a second run with
# nothing changed takes about a second.
#
#   1. .venv with Python 3.11 (created when missing)
#   2. pip install -r requirements.txt -c requirements/constraints.txt (skipped while a stamp
#      keyed on both files' hash matches)
#   3. rewrite the ROS wheels' CMake export files, which hard-code the wheel builder's
#      /opt/python/cp311-cp311 include dirs, to this venv's Python and numpy include dirs
#   4. build msg/*.msg and srv/*.srv with cmake and install into the venv itself, with launch/
#      and config/
#      (skipped while a stamp keyed on the inputs matches)
#   5. write .venv/.../site-packages/oxygen_ros_dev.pth (source tree + generated messages) and
#      the commands .venv/bin/oxygen_node and .venv/bin/oxygen-ros (rewritten only on change)
#   6. check that `import oxygen_ros` and `from oxygen_ros.msg import ...` work
#
# How the messages and the sources meet (why it is done this way):
# - The venv is already an ament prefix: the ros-* wheels install their libraries into .venv/lib
#   and their share/ and ament index into .venv/share. Our cmake build installs into the same
#   prefix, so liboxygen_ros__rosidl_*.so land in .venv/lib, where the wheels' own bootstrapper
#   (ros_wheels_bootstrapper.pth re-executes Python with LD_LIBRARY_PATH=.venv/lib:...) already
#   makes the loader look; rosidl's typesupport dispatch dlopen()s those libraries by bare name,
#   so an RPATH alone would not do. A prefix inside the venv is also what lets CMake export the
#   numpy include dir, which lies inside this source tree (.venv), without an error.
# - The generated Python (oxygen_ros/msg + C extensions) goes to .venv/lib/oxygen_ros_msgs_python,
#   not to site-packages, where its bare oxygen_ros/__init__.py would hide the source tree. The
#   .pth puts the repository root first and that directory second on sys.path, and
#   oxygen_ros/__init__.py extends its __path__ (pkgutil.extend_path), so `oxygen_ros.msg`
#   resolves to the generated package while every other module is the live source file: edits
#   take effect without reinstalling. Never `pip install .` into this venv: it would put a
#   copy of the sources into site-packages (the cmake install does not install the sources
#   here: -DOXYGEN_ROS_INSTALL_PYTHON=OFF).
# - The .pth also prepends .venv to AMENT_PREFIX_PATH in every Python process of the venv, so
#   ament_index finds share/oxygen_ros (launch and config files).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

venv="${OXYGEN_ROS_VENV:-$repo_root/.venv}"
python_for_venv="${OXYGEN_ROS_PYTHON:-python3.11}"
build_dir="$repo_root/build/cmake"
msgs_python_subdir="lib/oxygen_ros_msgs_python"

log() { printf '[setup_env %(%H:%M:%S)T] %s\n' -1 "$*"; }

hash_files() { cat "$@" | sha256sum | cut -d' ' -f1; }

# ---------------------------------------------------------------------------------------------
# 1. the venv
if [[ ! -x "$venv/bin/python" ]]; then
  if ! command -v "$python_for_venv" >/dev/null; then
    echo "error: $python_for_venv not found; set OXYGEN_ROS_PYTHON to a Python 3.11" >&2
    exit 1
  fi
  log "creating $venv with $("$python_for_venv" --version 2>&1)"
  "$python_for_venv" -m venv "$venv"
fi
py="$venv/bin/python"
py_version="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ "$py_version" != "3.11" ]]; then
  # the ros-* wheels are cp311 only
  echo "error: $venv has Python $py_version; the ROS 2 wheels need 3.11 (rm -r $venv)" >&2
  exit 1
fi
site_packages="$venv/lib/python3.11/site-packages"
if [[ -e "$site_packages/oxygen_ros" ]]; then
  # a `pip install .` copied the sources into site-packages: they would shadow the live tree,
  # and pip's uninstall step removes the generated messages (rebuilt below when missing)
  echo "error: $site_packages/oxygen_ros exists (pip install . into the dev venv?)." >&2
  echo "       Run: $venv/bin/pip uninstall -y oxygen_ros; rm -rf $site_packages/oxygen_ros" >&2
  exit 1
fi

# ---------------------------------------------------------------------------------------------
# 2. pinned packages
req_stamp="$venv/.oxygen_ros_requirements.sha256"
req_hash="$(hash_files requirements.txt requirements/constraints.txt)"
if [[ "$(cat "$req_stamp" 2>/dev/null)" != "$req_hash" ]]; then
  log "pip install -r requirements.txt (first time: several minutes, torch is large)"
  # --progress-bar on: pip shows per-file download progress even when not on a tty
  "$py" -m pip install --disable-pip-version-check --progress-bar on \
    -r requirements.txt -c requirements/constraints.txt
  echo "$req_hash" > "$req_stamp"
  log "packages installed"
else
  log "packages up to date (requirements hash matches)"
fi

# ---------------------------------------------------------------------------------------------
# 3. the wheels' CMake export files point at the wheel builder's Python; point them at ours
py_include="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
numpy_include="$("$py" -c 'import numpy; print(numpy.get_include())')"
mapfile -t stale_cmake_files < <(grep -rl --include='*.cmake' '/opt/python/cp311-cp311' \
  "$venv/share" "$venv/lib" "$site_packages" 2>/dev/null || true)
if (( ${#stale_cmake_files[@]} )); then
  log "rewriting ${#stale_cmake_files[@]} CMake export files to $py_include and $numpy_include"
  sed -i \
    -e "s#/opt/python/cp311-cp311/lib/python3\.11/site-packages/numpy/[_a-z]*core/include#${numpy_include}#g" \
    -e "s#/opt/python/cp311-cp311/include/python3\.11#${py_include}#g" \
    "${stale_cmake_files[@]}"
  if grep -l '/opt/python/cp311-cp311' "${stale_cmake_files[@]}"; then
    echo "error: the files above still name /opt/python/cp311-cp311 (unknown pattern)" >&2
    exit 1
  fi
fi

# ---------------------------------------------------------------------------------------------
# 4. messages: cmake configure + build + install into the venv prefix
msg_stamp="$venv/.oxygen_ros_msgs.sha256"
# launch/ and config/ too: the install copies them into share/ (what `ros2 launch` reads)
msg_hash="$(hash_files CMakeLists.txt package.xml msg/*.msg srv/*.srv scripts/setup_env.sh \
  requirements.txt $(find launch config -type f | LC_ALL=C sort))"
generated_msg_init="$venv/$msgs_python_subdir/oxygen_ros/srv/__init__.py"
if [[ "$(cat "$msg_stamp" 2>/dev/null)" != "$msg_hash" || ! -f "$generated_msg_init" ]]; then
  generator=()
  if command -v ninja >/dev/null; then generator=(-G Ninja); fi
  if [[ -f "$build_dir/CMakeCache.txt" ]] && ! grep -q "CMAKE_INSTALL_PREFIX:PATH=$venv\$" \
      "$build_dir/CMakeCache.txt"; then
    rm -rf "$build_dir"  # configured for another venv
  fi
  if [[ -f "$build_dir/CMakeCache.txt" ]]; then generator=(); fi  # keep the cached generator
  mkdir -p "$build_dir"
  log "cmake configure (build dir $build_dir)"
  # AMENT_PREFIX_PATH: rosidl finds the available typesupports through the ament index.
  AMENT_PREFIX_PATH="$venv" cmake -S . -B "$build_dir" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$venv" \
    -DCMAKE_PREFIX_PATH="$venv" \
    -DPython3_EXECUTABLE="$py" \
    -DPYTHON_INSTALL_DIR="$msgs_python_subdir" \
    -DOXYGEN_ROS_INSTALL_PYTHON=OFF \
    -DBUILD_TESTING=OFF \
    '-DCMAKE_INSTALL_RPATH=$ORIGIN;$ORIGIN/../..' \
    -DCMAKE_INSTALL_RPATH_USE_LINK_PATH=ON \
    > "$build_dir/configure.log" 2>&1 || { cat "$build_dir/configure.log" >&2; exit 1; }
  log "cmake build (C/C++ typesupport + Python extensions, tens of seconds on 2 cores)"
  cmake --build "$build_dir" --parallel "$(nproc)"
  log "cmake install into $venv"
  cmake --install "$build_dir" > "$build_dir/install.log"
  echo "$msg_hash" > "$msg_stamp"
else
  log "messages up to date (inputs hash matches)"
fi

# ---------------------------------------------------------------------------------------------
# 5. the source tree and the generated messages on sys.path, the venv on AMENT_PREFIX_PATH
pth="$site_packages/oxygen_ros_dev.pth"
{
  echo "$repo_root"
  echo "$venv/$msgs_python_subdir"
  # A .pth line that starts with `import` is executed at startup (the only way to run code).
  echo "import os; p = os.environ.get('AMENT_PREFIX_PATH', ''); v = '$venv'; \
os.environ['AMENT_PREFIX_PATH'] = p if v in p.split(os.pathsep) else os.pathsep.join(filter(None, [v, p]))"
} > "$pth.tmp"
mv "$pth.tmp" "$pth"

# The console scripts on the venv's PATH (the cmake install puts them in lib/oxygen_ros, where
# `ros2 run` looks). They run the live source tree like everything else in the venv, and keep
# DDS discovery on this machine unless ROS_AUTOMATIC_DISCOVERY_RANGE is set already.
write_command() {  # name module
  local path="$venv/bin/$1"
  printf '%s\n' \
    '#!/usr/bin/env bash' \
    "# Written by scripts/setup_env.sh: $1 of the oxygen_ros dev venv (python -m $2)." \
    'export ROS_AUTOMATIC_DISCOVERY_RANGE="${ROS_AUTOMATIC_DISCOVERY_RANGE:-LOCALHOST}"' \
    "exec \"$py\" -m $2 \"\$@\"" > "$path.tmp"
  chmod 755 "$path.tmp"
  if cmp -s "$path.tmp" "$path"; then rm -f "$path.tmp"; else mv "$path.tmp" "$path"; fi
}
write_command oxygen_node oxygen_ros.ros.node
write_command oxygen-ros oxygen_ros.cli
write_command chunk_player oxygen_ros.ros.chunk_player

# ---------------------------------------------------------------------------------------------
# 6. smoke check, run from outside the repo so the cwd does not put the sources on sys.path
(cd / && "$py" -c '
from ament_index_python.packages import get_package_share_directory
import oxygen_ros
import oxygen_ros.msg
from oxygen_ros.msg import ActionChunk, LanguageChunk
from oxygen_ros.srv import Ask
ActionChunk(), LanguageChunk(), Ask.Request(), Ask.Response()
print("[setup_env] ok: oxygen_ros %s from %s; messages from %s; share %s" % (
    oxygen_ros.__version__, oxygen_ros.__path__[0], oxygen_ros.msg.__path__[0],
    get_package_share_directory("oxygen_ros")))
')
