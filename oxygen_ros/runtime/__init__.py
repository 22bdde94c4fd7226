"""ROS-free application layer: what the node and the bag replay share.

params (the parameter table and its checks), inputs (newest messages -> observation),
conversions (message fields -> numpy), engine_setup (settings -> engine), frame_loop (the one
tick: act, emit, language, emit), control (the control thread), status (loop statistics,
problem log, diagnostic statuses), procfs (the one reader of /proc: CPU and memory figures).
"""
