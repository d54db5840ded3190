"""The jobs ``mpiscale`` runs: one declaration each, from which the command line, ``inspect`` and the docs' table
are built.

A new job is its own package (its settings dataclass, its entry point, its
results file and their report), one ``JobEntry`` below, an sbatch template in
``hpc/slurm/`` and its docs. Packages are named by module path and imported
only when their job runs or its results are inspected, so the layers stay
one-way (the job packages sit above this one) and ``mpiscale --help`` stays
fast (train's settings are read without importing torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Any


@dataclass(frozen=True)
class JobEntry:
    """What the command line needs to know of a job."""

    name: str  # the sub-command ("circuits run": the sub-command run of the command circuits)
    summary: str  # its line in ``mpiscale --help``
    description: str  # the first lines of ``mpiscale NAME --help``
    settings: str  # "module:Class": the settings dataclass (``jobs.option`` fields), one option per field
    entry: str  # "module:function": ``async function(system, settings) -> summary``, run on every rank
    results_format: str  # the ``format`` attribute of the file ``--out`` names
    report: str | None  # module with ``summarize(path)`` (and ``plot(path, image)``) for ``inspect``; None: none
    sbatch: str  # its Slurm template, relative to the repository
    steers: bool  # it calls ``jobs.steer`` at every step's end: it obeys SIGTERM, checkpoint and stop
    plots: bool = False  # ``report`` also has ``plot(path, image)`` (``inspect --plot``)
    needs: tuple[str, ...] = ()  # modules beyond the required ones that it imports (``mpiscale doctor`` checks them)
    extra: str = ""  # the setup.cfg extra that installs them (``pip install 'mpiscale[EXTRA]'``)

    def load(self, what: str) -> Any:
        """The object ``self.settings`` or ``self.entry`` names (``what`` is the attribute's name)."""
        module, name = getattr(self, what).split(":")
        return getattr(import_module(module), name)


JOBS: dict[str, JobEntry] = {
    entry.name: entry
    for entry in [
        JobEntry(
            "dictlearn",
            "distributed sparse dictionary learning (run under launch/mpiscale-run -n N)",
            "Learn a dictionary from FILE.h5:/dataset, or from a planted synthetic set when --data is not given.",
            "mpiscale.dictlearn.config:DictLearnConfig",
            "mpiscale.dictlearn.learner:learn",
            "mpiscale.dictlearn-results/1",
            "mpiscale.dictlearn.results",
            "hpc/slurm/dictlearn.sbatch",
            steers=True,
            plots=True,
        ),
        JobEntry(
            "encode",
            "sparse codes of a data set with a learned dictionary, written in parallel as CSR",
            "Code the signals of --data with the atoms of --dictionary (a dictlearn results file, or any atoms x "
            "features array), by OMP (at most L atoms, or to an error target) or Lasso.",
            "mpiscale.dictlearn.config:EncodeConfig",
            "mpiscale.dictlearn.encode:encode",
            "mpiscale.codes/1",
            "mpiscale.dictlearn.codes",
            "hpc/slurm/encode.sbatch",
            steers=True,
        ),
        JobEntry(
            "train",
            "data-parallel or pipeline training of an MLP or transformer classifier "
            "(run under launch/mpiscale-run -n N)",
            "Train on FILE.h5 (inputs and labels data sets), or on bundled data when --data is not given "
            "(scikit-learn's digits; synthetic token sequences for --model transformer).",
            "mpiscale.train.config:TrainConfig",
            "mpiscale.train.job:train",
            "mpiscale.train-results/1",
            "mpiscale.train.results",
            "hpc/slurm/train.sbatch",
            steers=True,
            plots=True,
            needs=("torch", "sklearn"),
            extra="torch",
        ),
        JobEntry(
            "collect",
            "a trained model's layer activations for a data set, written in parallel to one HDF5 file",
            "Run the model of a train results file over every row of --data and write the outputs of --layers to "
            "--out (one data set per layer, and sample_ids): the input of mpiscale dictlearn.",
            "mpiscale.train.config:CollectConfig",
            "mpiscale.train.collect:collect",
            "mpiscale.activations/1",
            "mpiscale.train.activations_report",
            "hpc/slurm/collect.sbatch",
            steers=True,
            needs=("torch",),
            extra="torch",
        ),
        JobEntry(
            "memstore",
            "the partitioned memory store on a synthetic workload (run under launch/mpiscale-run -n N)",
            "Reinforce, decay, aggregate and rank --records records for --iterations iterations; the results hold "
            "every iteration's aggregate and top-k, and NAME.records.h5 beside it (--out NAME.h5) the records.",
            "mpiscale.memstore.config:MemstoreConfig",
            "mpiscale.memstore.job:run_memstore",
            "mpiscale.memstore-results/1",
            "mpiscale.memstore.job",
            "hpc/slurm/memstore.sbatch",
            steers=True,
        ),
        JobEntry(
            "compress-adapters",
            "many LoRA adapters compressed into shared components per layer group (exact PCA over the ranks)",
            "Read the PEFT adapters of --adapters (each rank its share), find each layer group's shared components "
            "and write them with every adapter's loadings and errors to --out. A stopped run resumes (--resume); new "
            "adapters join an earlier file (--add-to).",
            "mpiscale.adapters.config:AdaptersConfig",
            "mpiscale.adapters.job:compress_adapters",
            "mpiscale.adapters/2",
            "mpiscale.adapters.results",
            "hpc/slurm/compress-adapters.sbatch",
            steers=True,
            plots=True,
            needs=("torch", "safetensors"),
            extra="adapters,torch",
        ),
        JobEntry(
            "circuits run",
            "every circuit of a catalogue on a data set, over the ranks (each model's shared prefix once per batch)",
            "Run every circuit of --catalogue (or those --where selects) on --data and write one column per circuit to "
            "--out, or a composition --plan of circuits and ops compiled over the ranks. A stopped or killed run "
            "resumes at its last written batch (--resume).",
            "mpiscale.circuits.config:CircuitsRunConfig",
            "mpiscale.circuits.job:run_circuits",
            "mpiscale.circuit-features/1",
            "mpiscale.circuits.features_report",
            "hpc/slurm/circuits-run.sbatch",
            steers=True,
            needs=("torch",),
            extra="torch",
        ),
    ]
}


def job_of_results(file_format: str) -> JobEntry | None:
    """The job whose results file has ``file_format`` (any version of it), or None."""
    kind = file_format.split("/")[0]
    return next((job for job in JOBS.values() if job.results_format.split("/")[0] == kind), None)


def jobs_with(has: str, last: str) -> str:
    """The jobs whose entry has ``has`` set (``report``, ``plots``), in words: "dictlearn, train or memstore"."""
    names = [name for name, entry in JOBS.items() if getattr(entry, has)]
    return f"{', '.join(names[:-1])} {last} {names[-1]}" if len(names) > 1 else names[0]


def jobs_table(brief: bool = False) -> str:
    """The jobs as a Markdown table: the guide holds the full one, the README the ``brief`` one (the job, what it
    does, its Slurm template); a test keeps both the same as this."""
    if brief:
        rows = ["| job | what it does | Slurm template |", "|---|---|---|"]
        rows += [f"| `mpiscale {job.name}` | {job.summary} | `{job.sbatch}` |" for job in JOBS.values()]
        return "\n".join(rows)
    rows = ["| job | what it does | results (`format`) | `inspect` | Slurm template | obeys stop/checkpoint |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for job in JOBS.values():
        inspected = ("summary, `--plot`" if job.plots else "summary") if job.report else "plain h5py"
        steered = "yes" if job.steers else "no (no steps to stop after)"
        rows.append(f"| `mpiscale {job.name}` | {job.summary} | `{job.results_format}` | {inspected} | "
                    f"`{job.sbatch}` | {steered} |")  # fmt: skip
    return "\n".join(rows)
