"""Layering: every folder of the package imports only the layers docs/design.md allows it.

Only ros/ and the tools above it import rclpy or other ROS Python packages (the engine,
runtime, replay and benchmark run without ROS; the node is a thin adapter), the two adapters
(ros/, bag/) never import each other, nothing but cli.py imports the tools, and no module
imports itself back through others, function-level imports included (docs/design.md, "Layers
and who may import whom"). Every folder must have a row in ALLOWED, so a new folder gets rules
before it gets code. Imports are read with ast, never executed.
"""

import ast
import collections
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


NODE_MAX_LINES = 400   # issue 23: the node is a thin lifecycle adapter; jobs go in ros/*.py


def test_the_node_stays_a_thin_adapter():
    lines = len((PACKAGE_DIR / 'ros' / 'node.py').read_text().splitlines())
    assert lines <= NODE_MAX_LINES, (
        f'ros/node.py has {lines} lines (at most {NODE_MAX_LINES}): move a job into a module of '
        'its own, as ros/ask_service.py, ros/robot_io.py and ros/parameters.py are')


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


# ---- import circles ---------------------------------------------------------------------------

def module_graph() -> dict[str, dict[str, int]]:
    """Return {module: {module of the package it imports: line}} over every file of the package.

    Function-level imports count as much as module-level ones (a circle through a lazy import
    still loads a half-initialised module when the function first runs). An imported name is
    the longest module prefix that exists (`from .engine import Engine` imports
    oxygen_ros.engine, `from . import run` oxygen_ros.bench.run). Importing a module first runs
    the __init__.py of its packages, so those that do not hold the importer count as imported.
    """
    files = {module_name(path): path for path in sorted(PACKAGE_DIR.rglob('*.py'))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        edges = graph.setdefault(name, {})
        for line, imported in imported_modules(path):
            while imported and imported not in files:
                imported = imported.rpartition('.')[0]
            targets = [imported]
            package = imported.rpartition('.')[0]
            while package in files:   # its packages' __init__, outside the importer's own
                if not is_within(name, {package}):
                    targets.append(package)
                package = package.rpartition('.')[0]
            for target in targets:
                if target and target != name:
                    edges.setdefault(target, line)
    return graph


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Return one circle per strongly connected group of modules, as [a, b, ..., a]."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(module: str) -> None:   # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    circles = []
    for group in groups:   # the shortest way from the group's first module back to it
        start, members = min(group), set(group)
        paths = {start: [start]}
        queue = collections.deque([start])
        while start not in graph[queue[0]]:
            module = queue.popleft()
            for target in sorted(graph[module]):
                if target in members and target not in paths:
                    paths[target] = paths[module] + [target]
                    queue.append(target)
        circles.append(paths[queue[0]] + [start])
    return circles


def describe(circle: list[str], graph: dict[str, dict[str, int]]) -> str:
    """One line per import of the circle: `module:line imports module`."""
    return '\n'.join(f'  {a}:{graph[a][b]} imports {b}' for a, b in zip(circle, circle[1:]))


def test_no_import_circle_anywhere_in_the_package():
    graph = module_graph()
    assert len(graph) > 100 and 'oxygen_ros.ros.node' in graph   # every module was read
    circles = import_circles(graph)
    assert not circles, 'import circles (function-level imports count):\n' + '\n\n'.join(
        describe(circle, graph) for circle in circles)


def test_circle_finder_sees_lazy_and_package_circles(tmp_path, monkeypatch):
    fake_package = tmp_path / 'oxygen_ros'
    (fake_package / 'bench').mkdir(parents=True)
    (fake_package / 'engine').mkdir()
    files = {
        '__init__.py': '',
        # bench: run -> robots -> memory -> run, the last one inside a function
        'bench/__init__.py': '',
        'bench/run.py': 'from .robots import run_robots\n',
        'bench/robots.py': 'from . import memory\n',
        'bench/memory.py': 'def probe():\n    from .run import make_system\n',
        # engine/__init__ runs before engine.types, which the runtime imports
        'engine/__init__.py': 'from oxygen_ros.engine.types import Obs\n'
                              'from oxygen_ros.runtime import Settings\n',
        'engine/types.py': '',
        'runtime.py': 'from .engine.types import Obs\n',
        'fine.py': 'import oxygen_ros.engine.types\n',
    }
    for path, text in files.items():
        (fake_package / path).write_text(text)
    monkeypatch.setitem(globals(), 'PACKAGE_DIR', fake_package)
    graph = module_graph()
    circles = sorted(import_circles(graph))
    assert circles == [['oxygen_ros.bench.memory', 'oxygen_ros.bench.run',
                        'oxygen_ros.bench.robots', 'oxygen_ros.bench.memory'],
                       ['oxygen_ros.engine', 'oxygen_ros.runtime', 'oxygen_ros.engine']]
    assert 'oxygen_ros.bench.memory:2 imports oxygen_ros.bench.run' in describe(circles[0], graph)
