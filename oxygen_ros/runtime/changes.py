"""Runtime parameter changes: what a change does to the settings, the KV pool and the engine.

ROS-free, so the node's post-set callback stays a dispatcher. Names are full parameter names
(`decode_budget`, `arm_left.decode_budget`); a plain node's one robot is the robot ''.

    check_fits(...)      refuse a budget / request-rate change the KV pool cannot hold
    with_change(...)     the settings after one accepted change (parsed, rate resolved)
    apply_to_engine(...) the control thread applies accepted changes between ticks
"""

from __future__ import annotations

import dataclasses

from oxygen_ros.engine import AdaptiveBudget, default_num_slots, FixedBudget, LanguagePolicy
from oxygen_ros.engine.workload import answer_tokens
from oxygen_ros.runtime.capacity import question_reserve, resolve_rate
from oxygen_ros.runtime.params import (FleetSettings, parse_decode_budget, parse_rtc_mode,
                                       split_param_name)

GATHER_SHARE = 0.05   # a robot due within this share of the shortest period is served early


def slots_needed(every_n_frames: int, tokens_per_request: int, k: int | None) -> int:
    """KV slots an engine sizes itself with for this request rate, N and k (None: adaptive)."""
    policy = LanguagePolicy(max_new_tokens=tokens_per_request, every_n_frames=every_n_frames)
    return default_num_slots(policy, k or 1)


def by_robot(changes: dict) -> dict[str, dict]:
    """Group changes by robot: {robot: {base name: value}} ('' for the node's own)."""
    grouped: dict[str, dict] = {}
    for name, value in changes.items():
        robot, base = split_param_name(name)
        grouped.setdefault(robot, {})[base] = value
    return grouped


def check_fits(settings: FleetSettings, kv_slots: dict[str, int], changes: dict) -> str:
    """Why a decode budget / request rate change would not fit a robot's KV slots ('' if it does).

    kv_slots: each robot's slots (its quota). A change that needs no more slots than the
    current values is always accepted.
    """
    grouped = by_robot(changes)
    for robot, s in settings.robots.items():
        mine = grouped.get(robot, {})
        if not {'decode_budget', 'request_every_n_frames'} & mine.keys():
            continue
        every = mine.get('request_every_n_frames', s.request_every_n_frames)
        k = parse_decode_budget(mine.get('decode_budget', s.decode_budget or 0))
        need = slots_needed(every, s.tokens_per_request, k)
        before = slots_needed(s.request_every_n_frames, s.tokens_per_request, s.decode_budget)
        slots = kv_slots[robot]
        if need > slots and need > before:
            quota = f'{robot}.kv_capacity' if robot else 'kv_capacity'
            return (f'{robot + ": " if robot else ""}decode_budget={k or "adaptive"} with '
                    f'request_every_n_frames={every} needs {need} KV slots (ceil(N/k) + 1) '
                    f'but the pool has {slots}: raise {quota} and reconfigure, or choose a '
                    'larger k')
    return ''


def with_change(settings: FleetSettings, name: str, value, capacity=None) -> FleetSettings:
    """Return the settings after `name` = `value` (a runtime parameter, already checked).

    control_rate_hz 0 (auto) resolves against the configure-time capacity. A node-level
    name of a fleet changes the shared values only; a robot's name, that robot's.
    """
    robot, base = split_param_name(name)
    value = (parse_decode_budget(value) if base == 'decode_budget'
             else parse_rtc_mode(value) if base == 'rtc_mode'
             else resolve_rate(value, capacity) if base == 'control_rate_hz' else value)
    robots = dict(settings.robots)
    node = settings.node
    if robot:
        robots[robot] = dataclasses.replace(robots[robot], **{base: value})
    else:
        node = dataclasses.replace(node, **{base: value})
        if '' in robots:   # a plain node: its one robot is the node
            robots[''] = dataclasses.replace(robots[''], **{base: value})
    return dataclasses.replace(settings, node=node, robots=robots)


def observe_tick(settler, engine, loop, outcomes: dict) -> bool:
    """Give `settler` (a RateSettler) one tick of `loop`; True once it has re-timed the rate.

    outcomes: what loop.tick returned; a tick without an action chunk is not counted.
    """
    acted = [o for o in outcomes.values() if o.action is not None]
    result = loop.last_result
    if settler.done or not acted or result is None:
        return False
    settler.observe(acted[0].duration_s, result.timings.total_s - result.timings.act_s,
                    node_reserve(engine, settler.capacity))
    return settler.done


def node_reserve(engine, capacity) -> float:
    """Return the question reserve at the auto robots' own step costs (their budgets').

    capacity.question_reserve with the budget's extend pass over the capacity's prompt tokens
    and its one-row step; 0 without questions or for a budget that prices nothing (fixed k).
    """
    if not capacity.ask_s:
        return 0.0
    tokens = capacity.extend[0] if capacity.extend is not None else 0
    reserves = [0.0]
    for name in engine.auto:
        scheduler = engine.system.scheduler(name)
        budget = scheduler.budget
        extend_s = budget.extend_estimate(tokens) if tokens else 0.0
        reserves.append(question_reserve(extend_s, budget.step_estimate(1),
                                         answer_tokens(scheduler.tasks)))
    return max(reserves)


def settle(engine, loop, settings: FleetSettings, settler) -> FleetSettings:
    """Apply a settler's re-timed rate to `engine`'s auto robots; return the new settings.

    Control thread only (as apply_to_engine). Nothing changes when the rate is kept.
    """
    rate = settler.new_rate_hz
    if rate is None:
        return settings
    changes = {f'{name}.control_rate_hz' if name else 'control_rate_hz': rate
               for name in engine.auto}
    for name, value in changes.items():
        settings = with_change(settings, name, value)
    engine.capacity = settler.retimed   # `control_rate_hz 0` later: the node's figure
    engine.description.update(retimed_description(settings, settler))
    apply_to_engine(engine.system, loop, settings, changes)
    return settings


def retimed_description(settings: FleetSettings, settler) -> dict:
    """Return the model status entries of rates re-timed by `settler` (a RateSettler)."""
    retimed = settler.retimed
    rates = {name: s.control_rate_hz for name, s in settings.robots.items()}
    # capacity_act_ms stays act() alone (the demo's node/engine ratio); the node's tick
    # outside its language round is a figure of its own.
    about = {'capacity_hz': retimed.rate_hz, 'capacity_node_tick_ms': 1e3 * retimed.act_s,
             'capacity': retimed.describe(max(rates.values())),
             'control_rate': "auto, re-timed on the node's first ticks"}
    if list(rates) == ['']:
        about['control_rate_hz'] = rates['']
    else:
        about['robot_rates_hz'] = ', '.join(f'{name} {hz:.3g}' for name, hz in rates.items())
    return about


def gather_s(settings: FleetSettings) -> float:
    """Return the frame loop's gather window for these robots' rates."""
    return GATHER_SHARE * min(s.period_s for s in settings.robots.values())


def apply_to_engine(engine, loop, settings: FleetSettings, changes: dict) -> None:
    """Apply accepted runtime changes to the engine and the loop (control thread only).

    engine: the FleetEngine; loop: its FrameLoop; settings: the values after the changes.
    """
    grouped = by_robot(changes)
    for robot, own in settings.robots.items():
        bases = set(grouped.get(robot, {}))
        if not bases:
            continue
        scheduler = engine.scheduler(robot)
        if 'request_every_n_frames' in bases:
            engine.set_policy(robot, dataclasses.replace(
                scheduler.policy, every_n_frames=own.request_every_n_frames))
        if 'decode_budget' in bases:
            k = own.decode_budget
            engine.set_budget(robot, FixedBudget(k) if k else AdaptiveBudget(
                own.period_s, k_max=scheduler.policy.max_request_len))
        elif 'control_rate_hz' in bases and isinstance(scheduler.budget, AdaptiveBudget):
            scheduler.budget.frame_period_s = own.period_s
        robot_loop = loop.robots[robot]
        if 'control_rate_hz' in bases:
            robot_loop.set_period(own.period_s)
        if any(base.startswith('rtc_') for base in bases) and robot_loop.rtc is not None:
            robot_loop.rtc.settings = own.rtc
    loop.gather_s = gather_s(settings)
