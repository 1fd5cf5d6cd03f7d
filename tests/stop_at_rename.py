"""Stop a real run at a chosen rename or removal inside its output directory (how the publication tests kill it).

Publishing a set of files is a sequence of renames (`os.replace`, `os.rename`) and removals (`os.remove`)
inside --output_dir; each is a place where a killed run must leave one complete set behind. Nothing in the
package knows about this: the process patches its own `os` functions before it runs.

In a test process (e.g. a forked child):

    stop_at(directory, lambda count, path: count == 3, signal.SIGKILL)  # just before the 3rd rename or removal

As a wrapper around a script (the signal is sent just before the first rename or removal of a path named NAME
inside the script's --output_dir, e.g. `.publishing`, the commit point):

    python tests/stop_at_rename.py SIGKILL NAME run_bridgetower_cuda.py --output_dir out ...
"""

import os
import runpy
import signal
import sys


def stop_at(directory, matches, signum) -> None:
    """Send `signum` to this process, once, just before the first rename or removal inside `directory` for which
    `matches(count, path)` holds (`count`: 1 for the first such call; `path`: the destination or removed path)."""
    inside = os.path.realpath(directory) + os.sep
    count, sent = 0, False

    def watched(original, path_argument):
        def call(*args, **kwargs):
            nonlocal count, sent
            path = os.path.realpath(args[path_argument])
            if path.startswith(inside) and not sent:
                count += 1
                if matches(count, path):
                    sent = True
                    os.kill(os.getpid(), signum)
            return original(*args, **kwargs)

        return call

    os.replace, os.rename, os.remove = watched(os.replace, 1), watched(os.rename, 1), watched(os.remove, 0)


def main() -> None:
    signame, name, script, *args = sys.argv[1:]
    output_dir = args[args.index("--output_dir") + 1]
    stop_at(output_dir, lambda count, path: os.path.basename(path) == name, getattr(signal, signame))
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
