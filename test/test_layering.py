"""Layering: every folder of the package imports only the layers DESIGN.md allows it.

Nothing but oxygen_ros/ros imports rclpy or other ROS Python packages (the engine, runtime,
replay and benchmark run without ROS; the node is a thin adapter), and the two adapters
(ros/, bag/) never import each other (DESIGN.md, "Layers and who may import whom"). Every
folder must have a row in ALLOWED, so a new folder gets rules before it gets code. Imports are
read with ast, never executed.
"""

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / 'oxygen_ros'
# folder -> the package's own layers it may import (besides itself). tools/ (and cli.py, the one
# module at the top of the package besides __init__.py) may import anything; no layer has
# 'tools' in its row, so nothing below the tools imports them.
ALLOWED = {
    'model': set(),
    'kv': set(),
    'engine': {'model', 'kv'},
    'runtime': {'engine', 'model'},
    'ros': {'runtime', 'engine', 'msg'},
    'bag': {'runtime', 'engine', 'dataset'},
    'bench': {'engine', 'runtime', 'model', 'kv', 'serve'},
    'serve': {'runtime', 'engine', 'model'},
    'dataset': set(),
    'tools': {'model', 'kv', 'engine', 'runtime', 'ros', 'bag', 'serve', 'dataset', 'bench',
              'msg'},
}
ROS_LAYERS = {'ros', 'tools'}   # tools sit above ros/ and bag/ (demo, soak, record-demo)
ROOT_MODULES = {'__init__.py', 'cli.py'}   # every other module lives in a layer's folder
ROS_FREE_LAYERS = sorted(set(ALLOWED) - ROS_LAYERS)
OWN_LAYERS = set(ALLOWED) | {'msg'}

# Top-level module names that mean "this needs a ROS install".
ROS_MODULES = {'rclpy', 'rcl_interfaces', 'rosidl_runtime_py', 'rosidl_parser',
               'ament_index_python', 'launch', 'launch_ros', 'std_msgs', 'sensor_msgs',
               'diagnostic_msgs', 'builtin_interfaces', 'geometry_msgs', 'lifecycle_msgs',
               'trajectory_msgs', 'rosbag2_py', 'cv_bridge', 'message_filters', 'tf2_ros'}
# Our own modules that are ROS: the node glue and the generated messages.
ROS_OWN_MODULES = {'oxygen_ros.ros', 'oxygen_ros.msg'}


def module_name(path):
    """Return the dotted module name of a file under oxygen_ros/."""
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix('').parts)
    if parts[-1] == '__init__':
        parts.pop()
    return '.'.join(parts)


def imported_modules(path):
    """Yield (line, absolute dotted name) of every import in a file, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding='utf-8'), filename=str(path))
    package = module_name(path)
    if path.name != '__init__.py':
        package = package.rpartition('.')[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split('.')
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = '.'.join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module
            yield node.lineno, base
            # `from oxygen_ros import msg` / `from .. import ros` import a submodule
            for alias in node.names:
                yield node.lineno, base + '.' + alias.name
        elif (isinstance(node, ast.Call) and getattr(node.func, 'attr', getattr(
                node.func, 'id', None)) in ('import_module', '__import__') and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value


def is_within(name, prefixes):
    """Return True when dotted `name` is one of `prefixes` or inside one of them."""
    return any(name == p or name.startswith(p + '.') for p in prefixes)


def layer_files(layer):
    """Return the Python files of one layer directory."""
    return sorted((PACKAGE_DIR / layer).rglob('*.py'))


def test_every_folder_has_rules():
    folders = {d.name for d in PACKAGE_DIR.iterdir()
               if d.is_dir() and d.name != '__pycache__' and any(d.rglob('*.py'))}
    assert folders == set(ALLOWED), 'folders without layering rules (add them to ALLOWED)'


def test_no_tool_module_at_the_package_root():
    root = {path.name for path in PACKAGE_DIR.glob('*.py')}
    assert root <= ROOT_MODULES, (f'modules at the top of oxygen_ros/: '
                                  f'{sorted(root - ROOT_MODULES)} (command-line tools go in '
                                  'oxygen_ros/tools/)')


@pytest.mark.parametrize('layer', sorted(ALLOWED))
def test_layer_exists(layer):
    assert (PACKAGE_DIR / layer).is_dir(), 'oxygen_ros/%s/ is missing' % layer
    assert layer_files(layer), 'oxygen_ros/%s/ has no Python files' % layer


@pytest.mark.parametrize('layer', ROS_FREE_LAYERS)
def test_layer_does_not_import_ros(layer):
    offences = []
    for path in layer_files(layer):
        for line, name in imported_modules(path):
            if name.split('.')[0] in ROS_MODULES or is_within(name, ROS_OWN_MODULES):
                offences.append('%s:%d imports %s' % (path.relative_to(PACKAGE_DIR.parent),
                                                      line, name))
    assert not offences, 'ROS imports below oxygen_ros/ros:\n' + '\n'.join(offences)


@pytest.mark.parametrize('layer', sorted(ALLOWED))
def test_layer_imports_only_what_it_may(layer):
    offences = []
    for path in layer_files(layer):
        for line, name in imported_modules(path):
            parts = name.split('.')
            if parts[0] != 'oxygen_ros' or len(parts) < 2 or parts[1] == layer:
                continue
            if parts[1] in OWN_LAYERS and parts[1] not in ALLOWED[layer]:
                offences.append('%s:%d imports %s' % (path.relative_to(PACKAGE_DIR.parent),
                                                      line, name))
    assert not offences, (f'{layer}/ may import only {sorted(ALLOWED[layer])}:\n'
                          + '\n'.join(offences))


def test_checker_sees_every_import_form(tmp_path, monkeypatch):
    # the checker itself: absolute, from-, relative and dynamic imports are all seen
    fake_package = tmp_path / 'oxygen_ros'
    (fake_package / 'engine').mkdir(parents=True)
    source = fake_package / 'engine' / 'bad.py'
    source.write_text('import rclpy.node\n'
                      'from rclpy import qos\n'
                      'from ..ros import node\n'
                      'from .. import msg\n'
                      'import importlib\n'
                      'importlib.import_module("rclpy")\n')
    monkeypatch.setitem(globals(), 'PACKAGE_DIR', fake_package)
    names = [name for _, name in imported_modules(source)]
    assert 'rclpy.node' in names
    assert 'rclpy' in names
    assert 'oxygen_ros.ros.node' in names
    assert 'oxygen_ros.msg' in names
    assert names.count('rclpy') >= 2
