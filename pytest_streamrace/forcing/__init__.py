"""Race forcing: put a program's gradient work on several streams, slow chosen streams down, compile it, and
compare its numbers with a reference run — the conditions under which stream races corrupt results.

Plain API (import the module you need; nothing here imports torch until used):
``accumulators.bind_accumulators`` / ``built_on_side_stream``, ``delays.Delays`` and its schedules,
``compile_modes.CompileMode``, ``referee.referee`` / ``poisoned_collective_inputs``. ``fixtures`` wires them to pytest.
"""

COMPILE_MODES = ("eager", "compile", "compiled_autograd")  # here, torch-free, for the marker's check at setup
COMPILE_BACKENDS = ("aot_eager", "inductor", "eager")
