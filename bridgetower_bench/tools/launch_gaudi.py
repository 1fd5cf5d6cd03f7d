"""Launch run_bridgetower.py on several HPUs of one Gaudi node (the published runs use 8, with MPI).

    PT_HPU_LAZY_MODE=1 python -m bridgetower_bench.tools.launch_gaudi --world_size 8 --use_mpi \\
        run_bridgetower.py --output_dir runs/test --model_name_or_path ... (script flags)

Built on optimum-habana's DistributedRunner, which writes the mpirun (or torch.distributed)
command line for the node's sockets and cores. `--dry_run` prints that command, preceded by the variables the
launch exports for it (MASTER_ADDR and MASTER_PORT with --use_mpi), and exits. Without Habana's software it
stops in one line (exit status 2) before optimum-habana is imported.
The processes it starts run lazy mode, as upstream's CI: PT_HPU_LAZY_MODE=1 is set for them unless
the variable is already set (PT_HPU_LAZY_MODE=0 with the script's `--use_lazy_mode False` for eager mode).

Several nodes (docs/RUNS.md, "Several Gaudi nodes"): `--hostfile FILE`, DeepSpeed's format (one `HOST slots=N`
line per node). optimum-habana's runner then starts the job with DeepSpeed's launcher, which reaches every
node with pdsh over ssh; DeepSpeed only starts the processes (the script gets no `--deepspeed`
configuration: training is the same data-parallel run as on one node). DeepSpeed's launcher does not pass
PT_HPU_LAZY_MODE to the nodes: the launcher hands it to them, with the lines of the user's own
`.deepspeed_env`, through a DeepSpeed environment file (`DS_ENV_FILE`), so every node runs the same mode.
optimum-habana's runner puts the hostfile's path and first host unquoted into a bash line: it reads the launcher's
own copy of the checked nodes (tools/hosts.py), written into the launch's temporary folder.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import shutil
import sys
import tempfile

from bridgetower_bench.guards.execution_mode import LAZY_MODE_VARIABLE
from bridgetower_bench.guards.habana_software import require_habana_software
from bridgetower_bench.tools import tool_paths
from bridgetower_bench.tools.hosts import excerpt, hostfile_flag, hostfile_nodes, machine, port
from bridgetower_bench.user_errors import UserInputError


# DeepSpeed's launcher passes to the nodes the lines of its environment files (`.deepspeed_env` in the home, then the
# working directory; the name from DS_ENV_FILE when set) and the variables whose names start with the prefixes its
# version lists: deepspeed_forwarded_names() reads them from the DeepSpeed installed here
DEEPSPEED_ENV_FILE = "DS_ENV_FILE"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--world_size",
        type=int,
        help="Number of HPUs on this node (1 to 8; default 1); with --hostfile, the job's total.",
    )
    parser.add_argument(
        "--hostfile", help="Several nodes: DeepSpeed's hostfile, one `HOST slots=N` line per node (N HPUs on it)."
    )
    parser.add_argument("--num_nodes", type=int, help="With --hostfile: how many nodes it must give (checked).")
    parser.add_argument(
        "--use_mpi", action="store_true", help="Start one process per HPU with mpirun (as the published runs)."
    )
    parser.add_argument("--master_port", default=29500, help="Port of the rank-0 process (1 to 65535).")
    parser.add_argument("--dry_run", action="store_true", help="Print the command that would run, and exit.")
    parser.add_argument("training_script", help="The script to run, e.g. run_bridgetower.py.")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER, help="The script's own flags.")
    args = parser.parse_args(argv)
    args.master_port = port(args.master_port, "--master_port")  # bad hosts and ports: one line (tool_paths.run)
    if args.hostfile is not None:
        args.nodes = check_several_nodes(parser, args)
    elif args.num_nodes is not None:
        parser.error("--num_nodes needs --hostfile (the nodes and their HPUs)")
    args.world_size = 1 if args.world_size is None else args.world_size
    if not 1 <= args.world_size <= 8 and args.hostfile is None:
        parser.error(f"--world_size={args.world_size}: a Gaudi node has 1 to 8 HPUs")
    if not os.path.isfile(args.training_script):
        parser.error(f"training_script {args.training_script}: no such file")
    return args


def check_several_nodes(parser, args) -> dict[str, int]:
    """The hostfile's nodes, once the flags agree with it and DeepSpeed's launcher can start them."""
    nodes = hostfile_nodes(args.hostfile)
    if args.num_nodes is not None and args.num_nodes != len(nodes):
        parser.error(f"--num_nodes={args.num_nodes}: {hostfile_flag(args.hostfile)} gives {len(nodes)} nodes")
    if args.world_size is not None and args.world_size != sum(nodes.values()):
        parser.error(
            f"--world_size={args.world_size}: {hostfile_flag(args.hostfile)} gives {sum(nodes.values())} HPUs "
            f"({', '.join(f'{host}: {slots}' for host, slots in nodes.items())})"
        )
    if args.use_mpi:
        parser.error("--use_mpi with --hostfile: several nodes are started by DeepSpeed's launcher, not mpirun")
    for program, role in (
        ("deepspeed", "DeepSpeed's launcher"),
        ("pdsh", "what DeepSpeed's launcher reaches the nodes with"),
    ):
        if shutil.which(program) is None:
            parser.error(
                f"--hostfile needs `{program}` ({role}) on PATH: run in Habana's container, with Habana's DeepSpeed "
                'build installed (docs/RUNS.md, "Several Gaudi nodes")'
            )
    refuse_unless_one_word(os.path.abspath("."), "the working directory")  # each node's line starts `cd DIR;`
    args.nodes_environment = nodes_environment(parser, children_mode_variable())
    return nodes


def nodes_environment(parser, mode: str, environ=os.environ) -> list[str]:
    """The `NAME=value` lines handed to every node through DeepSpeed's environment file: the user's own files
    (home, then working directory, as DeepSpeed reads them), then PT_HPU_LAZY_MODE. DeepSpeed's runner splits
    every line at its first "=" (`key, val = line.split("=", maxsplit=1)`), so a blank or comment line would stop
    it with a ValueError before any node starts: those are left out, another line without "=" is refused, and
    so is a file that sets another mode."""
    lines = []
    name = environ.get(DEEPSPEED_ENV_FILE, ".deepspeed_env")
    for path in (os.path.join(os.path.expanduser("~"), name), os.path.join(".", name)):
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for number, line in enumerate(f.read().splitlines(), 1):
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                key, equals, value = line.partition("=")
                if not equals:
                    parser.error(
                        f"{path}, line {number}: {line.strip()!r} is not NAME=value, and DeepSpeed's launcher reads "
                        "every line as one (a comment line starts with #)"
                    )
                if key.strip() == LAZY_MODE_VARIABLE and value.strip() != mode:
                    parser.error(
                        f"{path} sends {LAZY_MODE_VARIABLE}={value.strip()} to the nodes and this launch runs "
                        f"{LAZY_MODE_VARIABLE}={mode}: every node must run one mode (set the same value in both)"
                    )
                lines.append(line)
    return [*lines, f"{LAZY_MODE_VARIABLE}={mode}"]


def deepspeed_forwarded_names(environ=os.environ) -> list[str] | None:
    """The names of `environ`'s variables the installed DeepSpeed's launcher passes to the nodes, as its runner
    picks them: those starting with a prefix of its EXPORT_ENVS or of its accelerator's export_envs() (where its
    version has that method), less the names its EXCLUDE_ENVS holds back (where it has that table). None where
    DeepSpeed cannot be imported here: then which variables it passes is not known."""
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.launcher import runner
    except ImportError:
        return None
    accelerator = get_accelerator()
    prefixes = tuple(runner.EXPORT_ENVS) + tuple(getattr(accelerator, "export_envs", list)())
    held_back = {
        name for key, names in getattr(runner, "EXCLUDE_ENVS", {}).items() if key in environ for name in names
    }
    return [name for name in environ if name.startswith(prefixes) and name not in held_back]


def children_mode_variable(environ=os.environ) -> str:
    """PT_HPU_LAZY_MODE for the processes launched: as set, else 1 (lazy mode, upstream's CI's)."""
    return environ.get(LAZY_MODE_VARIABLE) or "1"


def main(argv=None) -> int:
    args = parse_args(argv)
    require_habana_software()
    os.environ[LAZY_MODE_VARIABLE] = children_mode_variable()  # read by Habana's bridge when each process loads it
    from optimum.habana.distributed import DistributedRunner  # imported late: it needs Habana's software

    command = " ".join(shlex.quote(a) for a in [args.training_script, *args.training_script_args])
    if args.hostfile is None:
        runner = DistributedRunner(
            command_list=[command], world_size=args.world_size, use_mpi=args.use_mpi, master_port=args.master_port
        )
        if args.dry_run:  # what run() would start, with the variables it sets for it
            variables = {LAZY_MODE_VARIABLE: os.environ[LAZY_MODE_VARIABLE], **runner._model_env_vars}
            shown = " ".join(f"{name}={shlex.quote(str(value))}" for name, value in variables.items())
            for line in runner._commands:
                print(f"{shown} {runner._interpreter}{line}")
            return 0
        return runner.run() or 0
    # Several nodes: optimum-habana starts them only through DeepSpeed, and its runner puts the hostfile's path and
    # first host unquoted into the bash line it runs: it reads the kit's copy of the checked nodes, in a folder of
    # the launch's own (removed after), whose path is one shell word.
    with tempfile.TemporaryDirectory(prefix="launch_gaudi-") as folder:
        refuse_unless_one_word(folder, "the temporary folder (TMPDIR)")
        hostfile = os.path.join(folder, "hostfile")
        with open(hostfile, "w") as f:
            f.write("".join(f"{host} slots={slots}\n" for host, slots in args.nodes.items()))
        runner = DistributedRunner(
            command_list=[command],
            world_size=args.world_size,
            master_port=args.master_port,
            hostfile=hostfile,
            use_deepspeed=True,
        )
        return print_node_commands(args, runner) if args.dry_run else run_on_nodes(args, runner, folder)


def refuse_unless_one_word(path: str, what: str) -> None:
    """A path that DeepSpeed's and optimum-habana's launchers put unquoted into a shell line must be one word there,
    holding no character the shell reads as code; else UserInputError."""
    if shlex.quote(path) != path:
        raise UserInputError(
            f"{what} {excerpt(path)}: DeepSpeed's launcher puts it unquoted into a shell line; use a path of letters, "
            "digits and '/', '.', '_', '-', '+', ',', ':', '@', '%', '='"
        )


def run_on_nodes(args, runner, folder: str) -> int:
    """Start the job: DeepSpeed's launcher reads the nodes' environment from a file named by DS_ENV_FILE (an
    absolute path takes the place of both of its `.deepspeed_env` files), written for the launch and removed after."""
    path = os.path.join(folder, "deepspeed_env")
    with open(path, "w") as f:
        f.write("".join(f"{line}\n" for line in args.nodes_environment))
    os.environ[DEEPSPEED_ENV_FILE] = path
    return runner.run() or 0


def print_node_commands(args, runner) -> int:
    """What `--hostfile` runs: the command on this node, then the one pdsh runs on each node (as DeepSpeed's
    launcher writes it) and the variables DeepSpeed's per-node launcher gives each of that node's processes."""
    nodes, cwd = args.nodes, os.path.abspath(".")
    master_addr = machine(next(iter(nodes)))  # as optimum-habana's runner reads it from the hostfile's copy
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [cwd, os.environ.get("PYTHONPATH")]))}
    forwarded = deepspeed_forwarded_names(environ)
    if forwarded is None:
        print(
            "# DeepSpeed cannot be imported by this Python: which of this node's variables its launcher passes to "
            "the nodes is not known; below, only the environment file's lines"
        )
    exports = [(key, environ[key]) for key in forwarded or []]
    given = (line.partition("=") for line in args.nodes_environment)
    exports += [(key.strip(), value.strip()) for key, equals, value in given if equals]
    world_info = base64.urlsafe_b64encode(json.dumps({h: list(range(n)) for h, n in nodes.items()}).encode()).decode()
    print(f"# on this node: {DEEPSPEED_ENV_FILE}=<a temporary file: {'; '.join(args.nodes_environment)}>")
    print(f"{LAZY_MODE_VARIABLE}={os.environ[LAZY_MODE_VARIABLE]} " + runner._interpreter + runner._commands[0])
    first_rank = 0
    for node_rank, (host, slots) in enumerate(nodes.items()):
        print(
            f"# node {node_rank}: {shlex.quote(host)}, ranks {first_rank}-{first_rank + slots - 1}, started by pdsh over ssh"
        )
        print(
            "".join(f"export {key}={shlex.quote(value)}; " for key, value in exports)
            + f"cd {shlex.quote(cwd)}; {shlex.quote(sys.executable)} -u -m deepspeed.launcher.launch --world_info={world_info} "
            f"--node_rank={node_rank} --master_addr={master_addr} --master_port={args.master_port} --no_local_rank "
            + runner._commands[0]
        )
        print(
            f"#   its processes: {LAZY_MODE_VARIABLE}={os.environ[LAZY_MODE_VARIABLE]} MASTER_ADDR={master_addr} "
            f"MASTER_PORT={args.master_port} WORLD_SIZE={sum(nodes.values())} RANK={first_rank}..{first_rank + slots - 1} "
            f"LOCAL_RANK=0..{slots - 1}"
        )
        first_rank += slots
    return 0


if __name__ == "__main__":
    tool_paths.run(main)
