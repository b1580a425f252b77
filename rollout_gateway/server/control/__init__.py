"""The control plane: the env's and the trainer's routes (admin token).

Register, trajectory, cancel, unregister and the policy version (:mod:`.plane`), and the
agents' exit reports as a stream (:mod:`.exit_stream`).
"""
