"""Bad input raises a clear error naming the argument, before any message is sent.

Every rank makes the same bad call, so every rank raises; a barrier afterwards shows
that nothing was left in flight.
"""

import numpy as np
import pytest
from mpi4py import MPI

import collectives as cc


def test_unknown_op_lists_the_valid_ones(comm):
    with pytest.raises(ValueError, match=r"op must be one of sum, prod, max, min, avg, band, bor, bxor; got 'mean'"):
        comm.allreduce(np.ones(4), op="mean")
    comm.barrier()


@pytest.mark.parametrize("collective", cc.COLLECTIVES)
def test_unknown_algorithm_lists_the_valid_ones(comm, collective):
    names = ", ".join(cc.algorithms(collective))
    with pytest.raises(ValueError, match=f"algorithm for {collective} must be one of {names}; got 'fastest'"):
        getattr(comm, collective)(np.ones(4), algorithm="fastest")
    for wrong in (["ring"], None, 3):  # not even a name: the same clear error
        with pytest.raises(ValueError, match=f"algorithm for {collective} must be one of"):
            getattr(comm, collective)(np.ones(4), algorithm=wrong)
    comm.barrier()


@pytest.mark.parametrize("dtype", ["int32", "uint8", "int64"])
def test_avg_on_integers(comm, dtype):
    with pytest.raises(TypeError, match=f"op 'avg' needs a floating or complex dtype; got {dtype}"):
        comm.allreduce(np.ones(4, dtype), op="avg")
    with pytest.raises(TypeError, match="avg"):
        comm.reduce_scatter(np.ones(4, dtype), op="avg")


@pytest.mark.parametrize("op", ["band", "bor", "bxor"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "complex128"])
def test_bitwise_ops_on_non_integers(comm, op, dtype):
    for collective in ("allreduce", "reduce_scatter", "reduce"):
        with pytest.raises(TypeError, match=f"op '{op}' needs an integer dtype; got {dtype}"):
            getattr(comm, collective)(np.ones(4, dtype), op=op)
    comm.barrier()


def test_max_on_complex(comm):
    with pytest.raises(TypeError, match="op 'max' is not defined for complex"):
        comm.allreduce(np.ones(4, "complex64"), op="max")


@pytest.mark.parametrize("dtype", ["bool", "object", "datetime64[s]", "longdouble", ">f4", "U3"])
def test_unsupported_dtype(comm, dtype):
    with pytest.raises(TypeError, match="x has"):
        comm.allreduce(np.zeros(3, dtype=dtype))


def test_out_of_the_wrong_shape_or_dtype(comm):
    with pytest.raises(ValueError, match=r"out must have shape \(4,\); got \(5,\)"):
        comm.allreduce(np.ones(4), out=np.ones(5))
    with pytest.raises(TypeError, match="out must have dtype float64; got float32"):
        comm.allreduce(np.ones(4), out=np.ones(4, "float32"))
    with pytest.raises(ValueError, match=rf"out must have shape \({comm.size}, 3\)"):
        comm.allgather(np.ones(3), out=np.ones((comm.size + 1, 3)))
    with pytest.raises(ValueError, match="out must have shape"):
        comm.reduce_scatter(np.ones(4 * comm.size), out=np.ones(5))
    with pytest.raises(TypeError, match="out must be a numpy.ndarray"):
        comm.allreduce(np.ones(4), out=[0.0] * 4)
    readonly = np.ones(4)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writable"):
        comm.allreduce(np.ones(4), out=readonly)
    comm.barrier()


@pytest.mark.parametrize("root", [-1, "size", 1.5, None, True])
def test_root_out_of_range(comm, root):
    root = comm.size if root == "size" else root
    with pytest.raises(ValueError, match=rf"root must be a rank in 0..{comm.size - 1}"):
        comm.broadcast(np.ones(3), root=root)
    with pytest.raises(ValueError, match="root must be a rank"):
        comm.reduce(np.ones(3), root=root)


def test_broadcast_needs_a_writable_array(comm):
    readonly = np.ones(3)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="x must be a writable array"):
        comm.broadcast(readonly)
    with pytest.raises(ValueError, match="x must be a writable array"):
        comm.broadcast(memoryview(bytes(8)))


@pytest.mark.parametrize("segment_size", [0, -8, 2.5, "big"])
def test_bad_segment_size(comm, segment_size):
    with pytest.raises(ValueError, match="segment_size must be a positive number of bytes"):
        comm.allreduce(np.ones(3), algorithm="tree", segment_size=segment_size)


def test_not_an_array(comm):
    with pytest.raises(TypeError, match="x must be an array or buffer of numbers; got object"):
        comm.allreduce(object())


def test_not_a_communicator():
    with pytest.raises(TypeError, match="mpi_comm must be an mpi4py intracommunicator"):
        cc.Communicator("world")
    with pytest.raises(TypeError, match="mpi_comm must be an mpi4py intracommunicator"):
        cc.Communicator(MPI.COMM_NULL)


def test_errors_derive_from_collective_error():
    assert issubclass(cc.TransportError, cc.CollectiveError)
    assert issubclass(cc.CollectiveError, RuntimeError)


def test_algorithms_lists_native_and_auto():
    assert cc.algorithms("allreduce") == (
        "ring", "tree", "recursive_halving", "recursive_doubling", "direct", "hierarchical", "hierarchical_leader",
        "shm", "one_shot", "two_shot", "leader", "native", "auto")
    assert cc.algorithms("reduce_scatter") == ("ring", "recursive_halving", "direct", "hierarchical", "shm",
                                               "one_shot", "leader", "native", "auto")
    assert cc.algorithms("allgather") == ("ring", "recursive_doubling", "bruck", "direct", "hierarchical", "shm",
                                          "one_shot", "leader", "native", "auto")
    assert cc.algorithms("broadcast") == ("binomial", "pipeline", "scatter_allgather", "direct", "hierarchical",
                                          "shm", "one_shot", "leader", "native", "auto")
    assert cc.algorithms("reduce") == ("binomial", "direct", "shm", "one_shot", "native", "auto")
    assert cc.algorithms("gather") == cc.algorithms("scatter") == ("binomial", "native", "auto")
    assert cc.algorithms("alltoall") == ("pairwise", "bruck", "native", "auto")
    assert cc.algorithms("alltoallv") == ("pairwise", "native", "auto")
    with pytest.raises(ValueError, match="collective must be one of .*alltoallv"):
        cc.algorithms("alltoallw")


def test_buffer_protocol_inputs_are_viewed(comm):
    # bytearray / memoryview / array.array are read through the buffer protocol.
    import array

    got = comm.allreduce(array.array("i", [1, 2, 3]), algorithm="ring")
    assert got.dtype == np.int32 and got.tolist() == [comm.size, 2 * comm.size, 3 * comm.size]
    got = comm.allgather(memoryview(bytearray(b"ab")), algorithm="bruck")
    assert got.shape == (comm.size, 2) and bytes(got[0]) == b"ab"


def test_scatter_arguments(comm):
    """scatter's x is one row per rank on the root; the other ranks may pass None with out."""
    size, root = comm.size, comm.size - 1
    with pytest.raises(ValueError, match=rf"x must have shape \(size, \*s\) = \({size}, \.\.\.\), one row per rank; "
                                         rf"got \({size + 1}, 3\)"):
        comm.scatter(np.ones((size + 1, 3)), root=root)
    with pytest.raises(ValueError, match="x must have shape"):
        comm.scatter(np.float64(1.0), root=root)  # 0-d: no rows at all
    if size > 1:  # a non-root (rank 0 is one when root is size-1 > 0) without x or out
        other_root = root if comm.rank != root else 0
        with pytest.raises(ValueError, match="x is None: pass out"):
            comm.scatter(None, root=other_root)
        with pytest.raises(TypeError, match="out must be a numpy.ndarray or a device array; got list"):
            comm.scatter(None, root=other_root, out=[0.0, 0.0, 0.0])
    if comm.rank == root:
        with pytest.raises(ValueError, match=rf"x must be an array on the root \(rank {root}\)"):
            comm.scatter(None, root=root, out=np.empty(3))
    with pytest.raises(ValueError, match=r"out must have shape \(3,\); got \(4,\)"):
        comm.scatter(np.ones((size, 3)), root=root, out=np.empty(4))
    comm.barrier()


def test_gather_out_is_checked_on_the_root_only(comm):
    """As MPI_Gather's receive buffer: only the root's out is used, so only its out is checked."""
    size, root = comm.size, 0
    wrong = np.empty((size + 1, 2))
    if comm.rank == root:
        with pytest.raises(ValueError, match=rf"out must have shape \({size}, 2\)"):
            comm.gather(np.ones(2), root=root, out=wrong)
    comm.barrier()  # the root refused before sending anything: nothing to match
    # The other ranks' out, however wrong, is neither checked nor touched.
    kept = wrong.copy()
    got = comm.gather(np.full(2, comm.rank, np.float64), root=root, out=None if comm.rank == root else wrong)
    if comm.rank == root:
        assert np.array_equal(got, np.repeat(np.arange(size, dtype=np.float64), 2).reshape(size, 2))
    else:
        assert got is None and np.array_equal(wrong, kept, equal_nan=True)
    comm.barrier()


def test_alltoall_arguments(comm):
    size = comm.size
    for x in (np.ones((size + 1, 2)), np.ones(()), np.ones(size + 2)):
        with pytest.raises(ValueError,
                           match=rf"x must have shape \(size, \*s\) = \({size}, \.\.\.\), one row per rank"):
            comm.alltoall(x)
    with pytest.raises(ValueError, match=rf"out must have shape \({size}, 3\); got \({size}, 4\)"):
        comm.alltoall(np.ones((size, 3)), out=np.empty((size, 4)))
    comm.barrier()
