#!/usr/bin/env bash
# Create or update .venv-openpi-client: a second venv holding openpi's unmodified robot client
# (openpi-client), which the server tests drive `oxygen-ros serve` with. A venv of its own because
# openpi-client pins numpy<2 and the project's .venv has numpy 2. Idempotent: skipped while a
# stamp keyed on requirements/openpi-client.txt matches.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

venv="${OXYGEN_ROS_CLIENT_VENV:-$repo_root/.venv-openpi-client}"
python_for_venv="${OXYGEN_ROS_PYTHON:-python3.11}"
requirements="requirements/openpi-client.txt"
stamp="$venv/.requirements.sha256"
hash="$(sha256sum "$requirements" | cut -d' ' -f1)"

if [[ -x "$venv/bin/python" && "$(cat "$stamp" 2>/dev/null)" == "$hash" ]]; then
  exit 0
fi
if [[ ! -x "$venv/bin/python" ]]; then
  "$python_for_venv" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --disable-pip-version-check --quiet -r "$requirements"
"$venv/bin/python" -c 'from openpi_client import websocket_client_policy'
echo "$hash" > "$stamp"
echo "[setup_openpi_client_venv] ok: $venv"
