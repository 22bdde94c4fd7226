"""`oxygen-ros robot-spec`: print a robot's spec as YAML, read from a LeRobot folder or checked.

    oxygen-ros robot-spec --from CHECKPOINT|DATASET > my_robot.yaml   # review, then keep it
    oxygen-ros robot-spec so101            # a shipped robot's spec, checked
    oxygen-ros robot-spec my_robot.yaml    # check a YAML: one line per problem, exit code 2

What was assumed (the files do not say it) goes to stderr and into the YAML's comments.
"""

from __future__ import annotations

import argparse
import sys

EXIT_ERROR = 2


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        'robot-spec', help="print a robot spec (YAML) read from a LeRobot checkpoint or dataset",
        description='Print a robot spec as YAML (docs/robots.md): read from a LeRobot π0.5 '
                    "checkpoint's config.json (input_features, output_features) or a LeRobot "
                    "dataset's meta/info.json (features, fps) with --from, or a shipped "
                    "robot's / a YAML file's, checked.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument('robot', nargs='?', help='a shipped robot name or a robot YAML to check')
    what.add_argument('--from', dest='source', metavar='PATH',
                      help='a LeRobot π0.5 checkpoint folder or a LeRobot dataset folder')
    parser.add_argument('--name', help='the robot name to write (default: from the source)')
    parser.add_argument('--out', metavar='FILE', help='write the YAML here instead of stdout')
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace) -> int:
    """Run `oxygen-ros robot-spec`; return the exit code."""
    import dataclasses

    from oxygen_ros.model.robot_spec import get_robot, RobotSpecError, spec_to_yaml
    from oxygen_ros.runtime.robot_source import infer_robot, inferred_yaml

    try:
        if args.source:
            inferred = infer_robot(args.source)
            if args.name:
                inferred = dataclasses.replace(
                    inferred, spec=dataclasses.replace(inferred.spec, name=args.name))
            for line in inferred.assumed:
                print(f'oxygen-ros robot-spec: assumed {line}', file=sys.stderr)
            text = inferred_yaml(inferred)
        else:
            spec = get_robot(args.robot)
            if args.name:
                spec = dataclasses.replace(spec, name=args.name)
            text = spec_to_yaml(spec, (f'Robot spec {spec.source} (checked).',))
    except RobotSpecError as err:
        print(f'oxygen-ros robot-spec: error: {err}', file=sys.stderr)
        return EXIT_ERROR
    if args.out:
        try:
            with open(args.out, 'x') as f:
                f.write(text)
        except OSError as err:
            print(f'oxygen-ros robot-spec: error: cannot write {args.out}: {err.strerror}',
                  file=sys.stderr)
            return EXIT_ERROR
        print(f'oxygen-ros robot-spec: wrote {args.out}', file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
