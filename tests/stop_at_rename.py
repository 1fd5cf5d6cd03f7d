"""Stop a real run at a chosen rename or removal inside its output directory (how the publication tests kill it).

Publishing a set of files is a sequence of renames (`os.replace`, `os.rename`) and removals (`os.remove`)
inside --output_dir; each is a place where a killed run must leave one complete set behind. Nothing in the
package knows about this: the process patches its own `os` functions before it runs.

In the process of the run (`helpers.ForkedRun(..., before=...)`, or a test's own forked child):

    stop_at(directory, lambda count, path: count == 3, signal.SIGKILL)  # just before the 3rd rename or removal
"""

import os


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
