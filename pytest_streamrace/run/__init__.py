"""``streamrace run [options] -- PROGRAM [ARGS...]``: a program (a training script, ``torchrun``, ``deepspeed``, ...)
under the race detector, every Python process it starts followed, their races merged into one report.

Data flows one way: ``options`` (the command line and the ini's defaults) → ``command`` (the policy, then following
the program's processes with ``children.following``) → ``job`` (starting and watching the program, signals) →
``report`` (records as they arrive, the merged report, JSON, trace, baseline, the exit status).
"""
