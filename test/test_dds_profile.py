"""The Fast DDS profile for raw camera frames: what it holds and which variable carries it."""

from pathlib import Path
import xml.etree.ElementTree as ET

import pytest

from oxygen_ros.runtime.dds_profile import (FASTDDS_VARIABLE, FASTRTPS_VARIABLE,
                                            profile_environment, profile_path,
                                            profile_variable)

REPO = Path(__file__).resolve().parents[1]
FRAME_1080P_RGB8 = 1920 * 1080 * 3


def _profile_tree():
    """The shipped profile's element tree, namespaces dropped from the tags."""
    root = ET.parse(profile_path()).getroot()
    for element in root.iter():
        element.tag = element.tag.rpartition('}')[2]
    return root


def test_the_profile_gives_a_shared_memory_segment_for_three_1080p_frames():
    assert profile_path() == REPO / 'config' / 'fastdds_large_frames.xml'
    root = _profile_tree()
    (shm,) = [d for d in root.iter('transport_descriptor') if d.findtext('type') == 'SHM']
    assert int(shm.findtext('segment_size')) >= 1.5 * 3 * FRAME_1080P_RGB8
    (participant,) = root.iter('participant')
    assert participant.get('is_default_profile') == 'true'
    # Listed first, so it is the one that sends; the built-in transports (UDP discovery) stay.
    assert participant.find('rtps/userTransports')[0].text == shm.findtext('transport_id')
    assert participant.findtext('rtps/useBuiltinTransports') == 'true'


@pytest.mark.parametrize('distro, variable', [
    ('humble', FASTRTPS_VARIABLE), ('jazzy', FASTRTPS_VARIABLE), ('kilted', FASTDDS_VARIABLE),
    ('rolling', FASTDDS_VARIABLE)])
def test_the_variable_is_the_one_this_fast_dds_reads(distro, variable):
    assert profile_variable({'ROS_DISTRO': distro}) == variable
    assert profile_environment('/p.xml', {'ROS_DISTRO': distro}) == {variable: '/p.xml'}


def test_a_profile_the_environment_names_is_kept():
    for name in (FASTDDS_VARIABLE, FASTRTPS_VARIABLE):
        assert profile_environment('/p.xml', {name: '/team.xml'}) == {}
        assert profile_environment('/p.xml', {name: '/team.xml', 'ROS_DISTRO': 'kilted'},
                                   keep_existing=False) == {FASTDDS_VARIABLE: '/p.xml'}
