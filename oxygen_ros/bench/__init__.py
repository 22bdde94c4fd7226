"""Benchmarks: the paper's experiments run side by side, with a component model and plots.

plan.py      what to run: groups of systems that see the same frames, quick and full plans
systems.py   the compared systems (action-only, isolated, shared, parallel, oxygen, adaptive)
phases.py    per-pass cost (prefill P, denoise D, decode step d(B)) and the ideal speedup
measure.py   per-system frame logs -> metrics; the token-identity check
cpu.py       other processes' load over a window; a process's CPU by thread (from procfs)
run.py       runs the groups (interleaved frame by frame), the phases and the memory probes
memory.py    peak-memory probe of one system in a fresh process
robots.py    part 'robots': R robots, one FleetEngine vs R engines (worker processes)
node.py      part 'node': oxygen_node as a process (with a stand-in robot and a monitor)
             next to the engine alone; started as processes, so no ROS import here
overload.py  part 'overload': the node with the shipped YAML, then asked twice its rate
tasks.py     part 'tasks': narration, a subtask and questions at once (node and engine)
serve.py     part 'serve': the policy server's per-request overhead
rtc.py       part 'rtc': real-time chunking off / guided / prefix on one episode
smooth_policy.py  the rtc part's default policy: a flow-matching fine-tune with smooth chunks
targets.py   each target with its measured value and whether it is met
report.py    CSV, result.json, the markdown summary
plots.py     the PNG plots
cli.py       the `oxygen-ros bench` sub-command
"""
