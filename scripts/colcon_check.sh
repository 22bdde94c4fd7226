#!/usr/bin/env bash
# Build this repository with colcon in a temporary workspace, against the ROS 2 wheels of the
# dev venv (.venv, made by setup_env.sh), then import the installed messages from it.
# Shows the repository root is a colcon package as robot teams build it. Env:
#   COLCON_BUILD_ARGS   extra `colcon build` arguments (e.g. --symlink-install)
#   KEEP_WS=1           keep the workspace (it is also kept when a step fails)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${OXYGEN_ROS_VENV:-$repo_root/.venv}"
colcon_venv="$repo_root/build/colcon-venv"
log() { printf '[colcon_check %(%H:%M:%S)T] %s\n' -1 "$*"; }

# 1. colcon in its own venv
stamp="$colcon_venv/.requirements.sha256"
want="$(sha256sum "$repo_root/requirements/colcon.txt" | cut -d' ' -f1)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  log "installing colcon into $colcon_venv"
  python_for_venv="$(readlink -f "$venv/bin/python")"
  "$python_for_venv" -m venv --clear "$colcon_venv"
  "$colcon_venv/bin/python" -m pip install -q --disable-pip-version-check \
    -r "$repo_root/requirements/colcon.txt"
  echo "$want" > "$stamp"
fi

# 2. a workspace with this package as its only source
ws="$(mktemp -d "${TMPDIR:-/tmp}/oxygen_ros_colcon.XXXXXX")"
log "workspace $ws"
mkdir -p "$ws/src/oxygen_ros"
if git -C "$repo_root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # tracked files and untracked ones that are not ignored: what a clone would have (+ edits)
  (cd "$repo_root" && git ls-files -z --cached --others --exclude-standard \
    | xargs -0 -I{} sh -c 'test -e "{}" && echo "{}"' | tr '\n' '\0' \
    | xargs -0 cp --parents -t "$ws/src/oxygen_ros")
else
  tar -C "$repo_root" --exclude=./.venv --exclude=./build --exclude=./install \
    --exclude=./log -cf - . | tar -C "$ws/src/oxygen_ros" -xf -
fi

# 3. colcon build: the venv's Python builds the message extensions (it has numpy and the
#    wheels), the venv prefix is the underlay (ament index, CMake configs)
log "colcon build ${COLCON_BUILD_ARGS:-}"
cd "$ws"
# shellcheck disable=SC2086
PATH="$venv/bin:$PATH" AMENT_PREFIX_PATH="$venv" CMAKE_PREFIX_PATH="$venv" \
  "$colcon_venv/bin/colcon" build --event-handlers console_direct+ ${COLCON_BUILD_ARGS:-} \
  --cmake-args -DPython3_EXECUTABLE="$venv/bin/python" -DBUILD_TESTING=OFF

# 4. use the install: colcon's setup script, then messages and sources from install/
log "checking the installed package"
export AMENT_PREFIX_PATH="$venv"  # the underlay, as during the build
set +u  # colcon's setup scripts read unset variables
# shellcheck disable=SC1091
source "$ws/install/setup.bash"
set -u
(cd / && "$venv/bin/python" - "$repo_root" "$ws" <<'PY'
import os
import sys

repo_root, ws = sys.argv[1], sys.argv[2]
# the dev venv's .pth puts the source tree and the dev messages first; drop them here
sys.path = [p for p in sys.path
            if os.path.realpath(p) != repo_root and 'oxygen_ros_msgs_python' not in p]
import oxygen_ros  # noqa: E402
from oxygen_ros.msg import ActionChunk, LanguageChunk  # noqa: E402
from rclpy.serialization import deserialize_message, serialize_message  # noqa: E402
from ament_index_python.packages import get_package_prefix  # noqa: E402

for module in (oxygen_ros, sys.modules['oxygen_ros.msg']):
    assert module.__file__.startswith(ws), (module.__file__, ws)
msg = ActionChunk(horizon=1, action_dim=2, actions=[0.5, -0.5])
assert deserialize_message(serialize_message(msg), ActionChunk) == msg
msg = LanguageChunk(token_ids=[1, 2], text_delta='ok', done=True, finish_reason='eos')
assert deserialize_message(serialize_message(msg), LanguageChunk) == msg
prefix = get_package_prefix('oxygen_ros')
assert prefix.startswith(ws), prefix
node = os.path.join(prefix, 'lib', 'oxygen_ros', 'oxygen_node')
assert os.access(node, os.X_OK), node
shebang = open(node).readline()[2:].strip()
print('[colcon_check] ok: oxygen_ros %s and its messages import from %s; %s runs %s'
      % (oxygen_ros.__version__, prefix, node, shebang))
PY
)
if [[ "${KEEP_WS:-0}" != 1 ]]; then rm -rf "$ws"; else log "kept $ws"; fi
log "colcon build of the repository root: OK"
