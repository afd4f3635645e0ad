"""aoprim.tools -- programs that use the server from the outside (clients), not part of it.

``loadgen``: the echo load generator behind ``python -m aoprim loadgen`` and bench/.
"""
