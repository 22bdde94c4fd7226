"""The package's build files agree with each other and with what got installed."""

import configparser
import os
from pathlib import Path
import re

from catkin_pkg.package import parse_package
import oxygen_ros

REPO_ROOT = Path(__file__).resolve().parents[1]


def cmake_console_scripts():
    """Return {script: 'module:function'} from OXYGEN_ROS_CONSOLE_SCRIPTS in CMakeLists.txt."""
    text = (REPO_ROOT / 'CMakeLists.txt').read_text()
    block = re.search(r'set\(OXYGEN_ROS_CONSOLE_SCRIPTS(.*?)\)', text, re.S).group(1)
    entries = re.findall(r'"([^"=]+)=([^"]+)"', block)
    return {name.strip(): target.strip() for name, target in entries}


def setup_cfg_console_scripts():
    """Return {script: 'module:function'} from setup.cfg's console_scripts."""
    parser = configparser.ConfigParser()
    parser.read(REPO_ROOT / 'setup.cfg')
    lines = parser.get('options.entry_points', 'console_scripts').strip().splitlines()
    return dict((part.strip() for part in line.split('=')) for line in lines)


def test_console_scripts_agree():
    scripts = cmake_console_scripts()
    assert scripts == setup_cfg_console_scripts()
    assert scripts['oxygen_node'] == 'oxygen_ros.ros.node:main'


def test_package_xml():
    package = parse_package(str(REPO_ROOT / 'package.xml'))
    assert package.name == 'oxygen_ros'
    assert package.package_format == 3
    assert package.get_build_type() == 'ament_cmake'
    assert package.version == oxygen_ros.__version__
    assert 'rosidl_interface_packages' in [group.name for group in package.member_of_groups]
    exec_depends = {dep.name for dep in package.exec_depends}
    assert {'rclpy', 'rosidl_default_runtime'} <= exec_depends


def test_every_msg_file_is_generated():
    listed = set(re.findall(r'"(msg/\w+\.msg)"', (REPO_ROOT / 'CMakeLists.txt').read_text()))
    present = {'msg/' + path.name for path in (REPO_ROOT / 'msg').glob('*.msg')}
    assert listed == present == {'msg/ActionChunk.msg', 'msg/LanguageChunk.msg'}


def test_installed_share_and_executables():
    # the environment this test runs in (make setup or colcon) installed the package
    from ament_index_python.packages import get_package_prefix, get_package_share_directory

    share = Path(get_package_share_directory('oxygen_ros'))
    assert (share / 'package.xml').is_file()
    assert (share / 'msg' / 'ActionChunk.msg').is_file()
    assert (share / 'launch').is_dir() and (share / 'config').is_dir()
    lib = Path(get_package_prefix('oxygen_ros')) / 'lib' / 'oxygen_ros'
    for script in cmake_console_scripts():
        path = lib / script
        assert path.is_file() and os.access(path, os.X_OK), path
        interpreter = path.read_text().splitlines()[0][2:].strip()
        assert os.access(interpreter, os.X_OK), 'shebang of %s: %s' % (path, interpreter)
