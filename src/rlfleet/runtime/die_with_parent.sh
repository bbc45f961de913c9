#!/bin/sh
# Started by multiprocessing in place of the Python interpreter (see
# rlfleet.runtime.launch.children_die_with_this_process): the child gets SIGKILL when the
# process that started it dies, then runs as usual.
exec setpriv --pdeathsig KILL -- "$RLFLEET_CHILD_PYTHON" "$@"
