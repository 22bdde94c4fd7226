"""Benchmarks: the paper's experiments run side by side, with a component model and plots.

phases.py    per-pass cost (prefill P, denoise D, decode step d(B)) and the ideal speedup
plan.py      what to run: groups of systems that see the same frames, quick and full plans
measure.py   per-system frame logs -> metrics; the token-identity check
run.py       runs the groups (interleaved frame by frame), the phases and the memory probes
memory.py    peak-memory probe of one system in a fresh process
node.py      part 'node': oxygen_node as a process (with a stand-in robot and a monitor)
             next to the engine alone; started as processes, so no ROS import here
rtc.py       part 'rtc': real-time chunking off / guided / prefix on the same episode
smooth_policy.py  the rtc part's default policy: a flow-matching fine-tune with smooth chunks
report.py    CSV, markdown summary, PNG plots
cli.py       the `oxygen-ros bench` sub-command
"""
