"""Every command of ``mpiscale``, declared once: the parser, every help list and the guide's commands table are
built from ``COMMANDS``.

A command is a name of one or more words (``circuits add`` is the sub-command
``add`` of ``circuits``), its help, its options, and its handler named as
``"module:function"``: imported only when the command runs, so ``mpiscale
--help`` stays fast and this module imports no workload. Jobs come from
``mpiscale.jobs.JOBS`` (one option per setting); a word that is not a command
itself (``circuits``, ``bench``) is a group, with its line in ``GROUPS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..jobs import JOBS, JobEntry, jobs_with


@dataclass(frozen=True)
class Option:
    """One argument of a command: argparse's flags (or a positional name) and its keywords."""

    flags: tuple[str, ...]
    settings: dict[str, Any]


def arg(*flags: str, **settings: Any) -> Option:
    """An option as argparse's ``add_argument`` takes it."""
    return Option(flags, settings)


@dataclass(frozen=True)
class Command:
    """A command or sub-command."""

    name: str  # its words: "index", "circuits add", "bench pingpong"
    summary: str  # its line in the help of the command above it
    handler: str  # "module:function": ``function(args) -> exit status``
    description: str = ""  # the first lines of its own --help (default: the summary)
    options: tuple[Option, ...] = ()
    one_of: tuple[Option, ...] = ()  # exactly one of these must be given
    job: JobEntry | None = None  # a job: one option per setting, and --config

    @property
    def words(self) -> list[str]:
        return self.name.split()


#: Words that group commands without being one: their line in the help above them.
GROUPS = {
    "circuits": "a catalogue of learned features as circuits, searched and run on data",
    "bench": "benchmarks, each against a baseline measured in the same run; a table, and a JSON record",
}

_JOB = "mpiscale.commands.jobs:run_job_command"
_QUICK = arg("--quick", action="store_true", help="fewer repetitions (a smoke run, noisier)")
_SCRATCH = arg("--dir", default="bench-scratch", help="scratch directory for its data (default: %(default)s)")
_WHERE = arg("--where", action="append", default=[], metavar="FILTER",
             help="KEY=VALUE (* and ? match), KEY!=VALUE, KEY>=N, KEY<N ..., tag=NAME; repeatable, and ';' separates "
             "several in one (all must hold)")  # fmt: skip
_BROKER = "the job's MQTT broker (default: MPISCALE_BROKER)"


def _bench(name: str, summary: str, *options: Option) -> Command:
    module = {"random": "sample_random"}.get(name, name)
    record = arg("--json", metavar="FILE.json", default=f"bench-{name}.json",
                 help="where to write the JSON record (default: %(default)s)")  # fmt: skip
    return Command(f"bench {name}", summary, f"mpiscale.bench.{module}:command", options=(*options, record, _QUICK))


_PLOT = arg("--plot", metavar="FILE.png", help="also draw the results (needs matplotlib)")


def _job(entry: JobEntry) -> Command:
    settings = "Settings come from the defaults, then --config FILE.toml, then these options."
    return Command(entry.name, entry.summary, _JOB, f"{entry.description} {settings}", job=entry)


_TOOLS = [
    Command(
        "doctor",
        "report MPI, h5py, numba/CUDA support, the optional extras and how to fix gaps",
        "mpiscale.doctor:command",
    ),  # fmt: skip
    Command(
        "demo",
        "runtime demo: actors pass tokens round a ring, then allreduce",
        "mpiscale.demo:command",
        options=(
            arg("--tokens", type=int, default=100, help="tokens each rank starts (default: 100)"),
            arg("--laps", type=int, default=3, help="laps of the ring each token makes (default: 3)"),
        ),
    ),  # fmt: skip
    Command(
        "compress-adapters export",
        "rebuild one adapter of a compressed file in the PEFT format (one process)",
        "mpiscale.adapters.export:command",
        "Rebuild adapter NAME of the compressed FILE (the --out of compress-adapters) in the PEFT format, into the "
        "new directory --to.",
        options=(
            arg("compressed", metavar="FILE", help="a compress-adapters results file"),
            arg("name", metavar="NAME", help="the adapter to rebuild"),
            arg("--to", metavar="DIRECTORY", help="the adapter's directory (default: ./NAME)"),
        ),
    ),
    Command(
        "index",
        "present several HDF5 files as one data set (an index file with a virtual data set)",
        "mpiscale.commands.files:index",
        "Write INDEX.h5, which mpiscale reads as the rows of FILES in order (globs are expanded in numeric order: "
        "run-2 before run-10), and plain h5py reads through a virtual data set.",
        options=(
            arg("index", metavar="INDEX.h5", help="the index file to write"),
            arg("files", nargs="+", metavar="FILE", help="HDF5 files (or quoted globs) in row order"),
            arg("--dataset", metavar="/PATH", help="the data set to index (default: every data set)"),
        ),
    ),
    Command(
        "inspect",
        f"summarize a results file of {jobs_with('report', 'or')}; --plot draws those of {jobs_with('plots', 'and')}",
        "mpiscale.commands.files:inspect",
        options=(
            arg("results", help=f"the file --out named in a job of {jobs_with('report', 'or')}"),
            arg(
                "--plot",
                metavar="FILE.png",
                help="draw the run's picture: learning curves, and for dictlearn the "
                "learned atoms against the planted ones",
            ),  # fmt: skip
            arg(
                "--top-inputs",
                type=int,
                metavar="N",
                help="dictlearn: for each atom, the N samples whose codes use it most, with their labels when known",
            ),
            arg("--atoms", type=int, default=20, help="--top-inputs: how many atoms to list (default: 20)"),
            arg("--data", metavar="FILE.h5:/X", help="--top-inputs: code these rows instead of the run's data"),
        ),  # fmt: skip
    ),
    Command(
        "watch",
        "a running job's progress, slowest rank and events, from its broker or its telemetry file",
        "mpiscale.commands.remote:watch",
        "Show a job's telemetry until it ends; exit 0 if it finished or stopped on request, 1 if it failed or was "
        "lost.",
        options=(
            arg("job", nargs="?", help="the job id (printed at its start; Slurm's job id under Slurm)"),
            arg("--broker", metavar="HOST:PORT", help=_BROKER),
            arg("--file", metavar="FILE.telemetry.jsonl", help="a job's telemetry file (no broker)"),
            arg("--no-follow", action="store_true", help="--file: show what is there now, then stop"),
            arg("--timeout", type=float, help="--broker: give up after this many seconds"),
        ),
    ),
    Command(
        "control",
        "send a running job a command: checkpoint, stop (checkpoint, then exit 0), dump, log-level LEVEL",
        "mpiscale.commands.remote:control",
        "Publish a command to a job's control topic and print its answers; exit 0 when the job completed it, 1 when "
        "it rejected it or did not answer. The broker's user, password and CA file come from MPISCALE_BROKER_USER, "
        "MPISCALE_BROKER_PASSWORD and MPISCALE_BROKER_CA.",
        options=(
            arg("job", help="the job id (printed at its start; Slurm's job id under Slurm)"),
            arg("command_name", metavar="command", choices=["checkpoint", "stop", "dump", "log-level"]),
            arg("level", nargs="?", help="log-level: DEBUG, INFO, WARNING or ERROR"),
            arg("--broker", metavar="HOST:PORT", help=_BROKER),
            arg("--timeout", type=float, default=60.0, help="seconds to wait for the answer (default: 60)"),
        ),
    ),
]

_CIRCUITS = [
    Command(
        "circuits add",
        "add a dictlearn results file's atoms, or a saved module, to a catalogue (created if missing)",
        "mpiscale.circuits.commands:add",
        "Add circuits to CATALOGUE.h5: each atom of a dictlearn results file (its model and layer found through its "
        "activations file, or given), or a user's module saved with torch.export or TorchScript.",
        options=(
            arg("catalogue", metavar="CATALOGUE.h5"),
            arg(
                "--model",
                default="",
                help="--dictlearn: the train results file (default: the one its activations file names)",
            ),
            arg("--layer", default="", help="--dictlearn: the layer (default: the activations' data set name)"),
            arg(
                "--data",
                default="",
                metavar="FILE.h5:/X",
                help="--dictlearn: the activations (default: the run's data)",
            ),
            arg(
                "--top",
                type=int,
                default=5,
                help="--dictlearn: top inputs kept per atom (0: skip the pass over the data; default: 5)",
            ),
            arg("--name", default="", help="--module: the circuit's name (several outputs: NAME/0, NAME/1 ...)"),
            arg("--inputs", type=int, default=0, help="--module: numbers per input row it takes"),
            arg(
                "--input-dtype",
                default="float32",
                choices=["float32", "float64", "int64"],
                help="--module: the type of its inputs (default: float32)",
            ),
            arg(
                "--projections",
                default="",
                metavar="FILE.npy",
                help="--module: project its output on these rows "
                "(FILE.npy or FILE.h5:/X; default: one circuit per output number)",
            ),
            arg("--tag", action="append", default=[], help="a tag for every circuit added (repeatable)"),
            arg(
                "--field",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="a field for every circuit added (repeatable; numbers where VALUE is one)",
            ),
            arg(
                "--fields",
                default="",
                metavar="FILE.json",
                help="fields from JSON: one object for all, or a list of one object per circuit",
            ),
            arg(
                "--embeddings",
                default="",
                metavar="FILE.npy",
                help="one vector per circuit for similarity search (FILE.npy or FILE.h5:/X; default: the atoms)",
            ),
            arg("--space", default="", help="the embeddings' space name (default: MODEL:LAYER)"),
        ),  # fmt: skip
        one_of=(
            arg("--dictlearn", metavar="RESULTS.h5", help="a dictlearn results file: one circuit per atom"),
            arg("--module", metavar="FILE.pt2", help="a module saved by torch.export.save or torch.jit.save"),
        ),
    ),
    Command(
        "circuits search",
        "circuits whose metadata match filters",
        "mpiscale.circuits.commands:search",
        "List the circuits matching every --where filter.",
        options=(
            arg("catalogue", metavar="CATALOGUE.h5"),
            _WHERE,
            arg("--limit", type=int, default=20, help="circuits to print (default: 20; 0: all)"),
            arg("--json", metavar="FILE.json", help="also write every match, with all columns, as JSON"),
        ),
    ),
    Command(
        "circuits similar",
        "the circuits nearest a circuit or a vector (exact cosine top-k, over the ranks)",
        "mpiscale.circuits.similar_command:similar_command",
        "Exact cosine top-k over one embedding space, after the --where filters; under the launcher each rank "
        "searches its block.",
        options=(
            arg("catalogue", metavar="CATALOGUE.h5"),
            arg("--to", action="append", default=[], metavar="NAME", help="a circuit (repeatable)"),
            arg(
                "--vector",
                metavar="FILE.npy",
                help="query vectors: one, or a matrix of one per row (FILE.npy or FILE.h5:/X)",
            ),
            arg(
                "--space",
                default="",
                help="the space to search (default: the circuit's, or the only one of the vector's length)",
            ),
            arg("-k", type=int, default=10, help="neighbours per query (default: 10)"),
            _WHERE,
            arg("--json", metavar="FILE.json", help="also write the neighbours as JSON"),
        ),  # fmt: skip
    ),
]

_BENCHMARKS = [
    _bench("pingpong", "actor ask/tell vs raw mpi4py (2 ranks)", _PLOT),
    _bench("allreduce", "the hierarchical allreduce's bus bandwidth vs MPI.Allreduce, the same messages in a bare "
           "non-blocking loop (the floor of a Python caller), and torch.distributed gloo (any ranks)",
           _PLOT, arg("--compute-ms", type=float, default=0.0,
                      help="work through memory for this long before each call, as a job's iterations do "
                           "(default: 0, calls back to back)")),  # fmt: skip
    _bench("ddp", "a training step of mpiscale.train.DataParallel vs torch DDP with gloo, or NCCL with --device cuda "
           "(any ranks)", arg("--device", choices=("cpu", "cuda"), default="cpu",
                              help="where the models train (default: cpu; cuda: one rank per GPU)")),  # fmt: skip
    _bench("pipeline", "a pipeline training step (1F1B, GPipe) vs one process, the ideal pipeline, the same "
           "pipeline by hand in raw mpi4py (its steps in turns with ours), and torch.distributed.pipelining on gloo "
           "(2+ ranks, one stage each)",
           _PLOT),  # fmt: skip
    _bench("memstore", "memory store: decay vs numpy and a memory copy; full iterations at 1M and 10M records "
           "(any ranks)"),  # fmt: skip
    _bench("random", "per-sample random parameters vs a numpy generator per sample (any ranks)",
           arg("--samples", type=int, help="samples to generate (default: 4,000,000; 200,000 with --quick)")),
    _bench("rounds", "rounds of rows written and read collectively (RowWriter, ShardedDataset), and a growing data "
           "set's rounds, vs h5py's own collective transfer of the same rows, 4 KiB to 16 MiB a rank (any ranks)",
           _SCRATCH),
    _bench("marks", "what a job's marks of its rows done cost: mpiscale encode and collect in small rounds, marked at "
           "most every quarter second (the default) and every round, vs marking the first round and the last only "
           "(any ranks)",
           _SCRATCH),
    _bench("checkpoint", "level-1/level-3/background saves and loads vs the disk and torch.save (any ranks)",
           arg("--size-mib", type=int, help="total state in MiB (default: 1024; 128 with --quick)"), _SCRATCH),
    _bench("adapters", "compressing N planted LoRA adapters: ours at 1, 2 and 4 ranks vs one process's covariance "
           "and eigh, chunked meta-PCA and scikit-learn PCA, and ours on the GPU where torch sees one (one process, "
           "no mpirun; it launches ours)", _SCRATCH,
           arg("--sizes", metavar="DxN,...", help="the settings, dimension x adapters (default: every setting; "
               "256x10,256x100 with --quick)")),  # fmt: skip
    _bench("circuits", "similar search vs numpy and faiss IndexFlatIP at 1/10/100%% filter selectivity; 100 "
           "feature circuits at once vs one at a time (one process, no mpirun)"),
    _bench("graph", "a 16-node circuit plan sequential (the floor), as one remote call per node, and compiled "
           "over the ranks: overhead per cross-rank edge (2 ranks)"),
    _bench("omp", "Batch-OMP sparse coding vs scikit-learn's orthogonal_mp_gram (one process, no mpirun)"),
    _bench("encode", "coding new data by sparsity and to an error target vs scikit-learn's sparse_encode and SPAMS's "
           "omp, all cores each (one process, no mpirun)"),
    _bench("lasso", "Lasso coding vs SPAMS's lasso and scikit-learn's sparse_encode (lasso_lars), one core each, "
           "on random atoms and atoms from photos (one process, no mpirun)"),
    _bench("dictlearn", "time to reach the errors of scikit-learn MiniBatchDictionaryLearning and SPAMS trainDL, "
           "time per iteration, OMP throughput (any ranks)", _SCRATCH,
           arg("--data", choices=("planted", "patches"), default="planted",
               help="planted: a planted dictionary plus noise; patches: 8x8 patches of scikit-learn's sample photos "
               "against SPAMS on one thread, ours stopping at its error (default: %(default)s)")),
    _bench("reader", "read bandwidth vs np.fromfile, and reading's share of dictlearn training, in memory and "
           "streamed", _SCRATCH),
    _bench("batching", "ragged samples within a memory budget: sequential, round-robin, memory and adaptive "
           "batching vs PyTorch's DataLoader with 0 and 2 workers, and vs unbounded read-ahead (one process, no "
           "mpirun)", _SCRATCH),
    _bench("telemetry", "a dictlearn run with telemetry off, to a file, to mosquitto and to a broker that never "
           "answers", _SCRATCH),
]  # fmt: skip

COMMANDS: list[Command] = [*_TOOLS[:2], *(_job(entry) for entry in JOBS.values()), *_TOOLS[2:], *_CIRCUITS,
                           *_BENCHMARKS]  # fmt: skip


def children(words: list[str]) -> list[str]:
    """The next words after ``words`` of every command below it, in declaration order (no repeats)."""
    depth = len(words)
    found = [c.words[depth] for c in COMMANDS if len(c.words) > depth and c.words[:depth] == words]
    return list(dict.fromkeys(found))


def commands_table() -> str:
    """Every command with its summary, as a Markdown table (docs/guide.md holds it; a test keeps the two the same)."""
    rows = ["| command | what it does |", "|---|---|"]
    rows += [f"| `mpiscale {command.name}` | {command.summary.replace('%%', '%')} |" for command in COMMANDS]
    return "\n".join(rows)
