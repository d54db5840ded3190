"""Which Open MPI cannot start under srun's PMI-2 plugin, read from its own ``ompi_info`` (the refusal itself, under
a real Slurm: tests/integration/test_slurm.py)."""

import re
import subprocess

from mpiscale.srun_tasks import open_mpi_without_pmi2, without_pmi2

LIBRARY = "Open MPI 4.1.4 (/opt/lib/libmpi.so.40)"

#: The lines of the two components an Open MPI configured --with-pmi lists beside the others.
PMI_CLIENTS = "".join(f'mca:pmix:{name}:version:"mca:2.1.0"\nmca:pmix:{name}:version:"component:4.1.4"\n'
                      for name in ("s1", "s2"))  # fmt: skip


def this_machines_listing() -> str:
    return subprocess.run(["ompi_info", "--parsable"], capture_output=True, text=True, check=True).stdout


def test_an_open_mpi_whose_pmix_components_hold_no_pmi_client_is_named():
    """Debian's Open MPI (the one launch/setup.sh installs) lists ext3x, flux and isolated: PMIx alone."""
    listing = this_machines_listing()
    assert re.search(r"^mca:pmix:ext3x:version:", listing, re.MULTILINE)
    assert without_pmi2(LIBRARY, listing) == LIBRARY


def test_an_open_mpi_with_slurms_pmi_clients_or_without_pmix_components_is_not():
    listing = this_machines_listing()
    assert without_pmi2(LIBRARY, listing + PMI_CLIENTS) is None
    no_components = "\n".join(line for line in listing.splitlines() if not line.startswith("mca:pmix:"))
    assert without_pmi2(LIBRARY, no_components) is None  # Open MPI 5 (PMIx built in), or a listing that says nothing


def test_the_library_mpi4py_loads_is_found_without_starting_mpi():
    """Named from a child process, by its version and the libmpi file it maps; MPI does not start here."""
    named = open_mpi_without_pmi2()
    assert named is not None and re.fullmatch(r"Open MPI \d+\.\d+\.\d+\w* \(/\S+/libmpi\.so[.\d]*\)", named), named
