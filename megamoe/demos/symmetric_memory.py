"""Symmetric memory, hands on: every rank maps every peer's buffer, and ``map(ptr, r)`` is pointer arithmetic.

* :data:`HELLO` -- rank 0 writes into every peer's buffer, every rank reads every peer's stamp (notebook 01);
* :data:`MAP_DEMO` -- ``map(&x[3], r)`` by hand against the mapped address, then a remote read (pull) and a remote
  write (push) with the Triton copy kernels, checked byte for byte (notebook 02);
* the same read/write with the CuPy/CUDA ``SymBuffer`` kernels (one GPU per rank, or local ranks on one GPU).

The phase lists run through :func:`megamoe.harness.run_phased`.
"""
from __future__ import annotations

import inspect
import os

import torch

from megamoe.env import cuda_available
from megamoe.harness import base_info, sync
from megamoe.kernels import symm as ks
from megamoe.symm import SymmBuffer


def hex_bytes(t: torch.Tensor, n: int = 8) -> str:
    """The first ``n`` bytes of a tensor as hex (``"21 21 21 ..."``)."""
    b = t.detach().reshape(-1).cpu().view(torch.uint8)[:n].tolist()
    return " ".join(f"{v:02x}" for v in b)


def own_shm_files() -> list[str]:
    """``/dev/shm`` files this process created (``megamoe-<pid>-*``); empty once a SymmBuffer is set up."""
    from megamoe.symm import shm_files_of

    return sorted(shm_files_of(os.getpid()))


def shm_mappings() -> list[str]:
    """The megamoe shm segments mapped into this process, from ``/proc/self/maps`` (``path (deleted)`` when the file
    was unlinked; the mapping stays valid)."""
    from megamoe.symm import SHM_DIR, SHM_PREFIX

    shm_prefix = os.path.join(SHM_DIR, SHM_PREFIX)
    try:
        with open("/proc/self/maps") as f:
            lines = [ln.split(maxsplit=5) for ln in f if shm_prefix in ln]
    except OSError:
        return []
    seen = []
    for parts in lines:
        name = parts[5].strip() if len(parts) > 5 else ""
        if name not in seen:
            seen.append(name)
    return [os.path.basename(s) for s in seen]


def hello_write(sb: SymmBuffer, out: dict) -> None:
    """Phase 1: stamp ``topk_idx[0, 0] = 100 + rank`` in my own buffer; rank 0 also writes ``1000 + p`` straight
    into ``topk_idx[1, 0]`` of every rank ``p`` (a remote write through the peer's mapping)."""
    sb.topk_idx[0, 0] = 100 + sb.rank
    if sb.rank == 0:
        for p in range(sb.num_ranks):
            sb.peer_view(p, "topk_idx")[1, 0] = 1000 + p
    out["shm_files_still_linked"] = own_shm_files()


def hello_read(sb: SymmBuffer, out: dict) -> None:
    """Phase 2 (after a barrier): read every rank's stamp through its mapping, and what rank 0 wrote into mine;
    list the shm segments this process maps (every rank has unlinked its file by now)."""
    out["shm_mappings"] = shm_mappings()
    out["stamps_seen"] = [int(sb.peer_view(p, "topk_idx")[0, 0]) for p in range(sb.num_ranks)]
    out["written_by_rank0"] = int(sb.topk_idx[1, 0])


HELLO = (hello_write, hello_read)


# ---------------------------------------------------------------------------------------------- map and remote access
#: Rows each rank reads from / writes to a peer in the remote-access demo.
DEMO_ROWS = 4


def row_pattern(rank: int, rows: int, cols: int) -> torch.Tensor:
    """u8 ``[rows, cols]``: byte ``0x<rank+1><row>`` in every column, so a row names its owner and index in hex."""
    r = torch.arange(rows, dtype=torch.int32)[:, None].expand(rows, cols)
    return ((rank + 1) * 16 + r % 16).to(torch.uint8)


def map_fill(sb: SymmBuffer, out: dict) -> None:
    """Phase 1: fill ``x`` with :func:`row_pattern`; compute ``map(&x[3], r)`` for every rank ``r`` by hand and
    compare with the address of ``x[3]`` in rank ``r``'s buffer as mapped into this process."""
    L = sb.layout
    sb.x.view(torch.uint8)[:DEMO_ROWS].copy_(row_pattern(sb.rank, DEMO_ROWS, L.hidden).to(sb.device))
    ptrs = sb.buffer_ptrs.tolist()
    seg, row = L["x"], 3
    row_bytes = seg.nbytes // seg.shape[0]
    local = ptrs[sb.rank] + seg.offset + row * row_bytes
    table = []
    for r in range(sb.num_ranks):
        delta = ptrs[r] - ptrs[sb.rank]
        table.append({"dst_rank": r, "base[dst]": hex(ptrs[r]), "delta = base[dst]-base[me]": delta,
                      "map(&x[3], dst)": hex(local + delta),
                      "&x[3] in dst's buffer": hex(sb.peer_view(r, "x")[row].data_ptr()),
                      "equal": local + delta == sb.peer_view(r, "x")[row].data_ptr()})
    out.update(x_offset=seg.offset, row_bytes=row_bytes, local_addr=hex(local), map_table=table)


def map_access(sb: SymmBuffer, out: dict) -> None:
    """Phase 2: with the Triton copy kernel (``sym_map`` inside), *pull* rows 0..3 of the next rank's ``x`` into my
    ``l1_acts[0:4]`` (remote read) and *push* my rows 0..3 into the next rank's ``l1_acts[4:8]`` (remote write)."""
    peer = (sb.rank + 1) % sb.num_ranks
    rows = list(range(DEMO_ROWS))
    ks.pull_rows(sb, peer, "x", rows, rows, dst_segment="l1_acts")
    ks.push_rows(sb, peer, "x", rows, [DEMO_ROWS + i for i in rows], dst_segment="l1_acts")
    out["pulled_from"], out["pushed_to"] = peer, peer


def map_check(sb: SymmBuffer, out: dict) -> None:
    """Phase 3: read my ``l1_acts[0:8]`` and check it against the patterns of the ranks that filled it."""
    R, H = sb.num_ranks, sb.layout.hidden
    acts = sb.l1_acts.view(torch.uint8)[:2 * DEMO_ROWS].cpu()
    nxt, prev = (sb.rank + 1) % R, (sb.rank - 1) % R
    out["pulled_rows"] = [hex_bytes(acts[i], 6) for i in range(DEMO_ROWS)]
    out["pushed_rows"] = [hex_bytes(acts[DEMO_ROWS + i], 6) for i in range(DEMO_ROWS)]
    out["pull_ok"] = bool(torch.equal(acts[:DEMO_ROWS], row_pattern(nxt, DEMO_ROWS, H)))
    out["push_ok"] = bool(torch.equal(acts[DEMO_ROWS:], row_pattern(prev, DEMO_ROWS, H)))


MAP_DEMO = (map_fill, map_access, map_check)


def sym_map_source() -> str:
    """Source of the Triton ``sym_map`` device function (``megamoe.kernels.symm``)."""
    fn = getattr(ks.sym_map, "fn", ks.sym_map)
    return inspect.getsource(fn)


def cuda_header(name: str = "sym_buffer.cuh") -> str:
    """Text of ``kernels/cuda/<name>``."""
    from megamoe.kernels.cupy_prims import CUDA_DIR

    return (CUDA_DIR / name).read_text()



# ---------------------------------------------------------------------------------------------------- CuPy / CUDA
def cupy_available() -> bool:
    """True when CuPy imports and sees a GPU (the CUDA ``SymBuffer`` demo can run)."""
    if not cuda_available():
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _cupy_copy_and_check(sb: SymmBuffer, buffer_ptrs, peer: int, out: dict) -> None:
    from megamoe.kernels import cupy_prims

    L, H = sb.layout, sb.layout.hidden
    cupy_prims.pull_rows(buffer_ptrs, sb.rank, peer, L.offset("x"), L.offset("l1_acts"), DEMO_ROWS, H)
    cupy_prims.push_rows(buffer_ptrs, sb.rank, peer, L.offset("x"), L.offset("l1_acts") + DEMO_ROWS * H,
                         DEMO_ROWS, H)
    out["pulled_from"] = out["pushed_to"] = peer


def cupy_rank_read_write(rank: int, world_size: int, shape: dict) -> dict:
    """One GPU per rank: fill ``x``, CUDA barrier (``barrier.cuh``), pull the next rank's rows and push mine into it
    with ``pull_rows``/``push_rows`` (``SymBuffer::map`` + 1-D bulk copies), barrier, check ``l1_acts[0:8]``."""
    from megamoe.kernels import cupy_prims

    sb = SymmBuffer(None, **shape)
    try:
        L = sb.layout
        out = base_info(sb)
        sig, st = L.offset("barrier_signal"), L.offset("barrier_state")
        sb.x.view(torch.uint8)[:DEMO_ROWS].copy_(row_pattern(rank, DEMO_ROWS, L.hidden).to(sb.device))
        cupy_prims.barrier(sb.buffer_ptrs, rank, sig, st, tag=1)
        _cupy_copy_and_check(sb, sb.buffer_ptrs, (rank + 1) % world_size, out)
        cupy_prims.barrier(sb.buffer_ptrs, rank, sig, st, tag=2)
        sync(sb)
        ks.check_barrier_state(sb)
        map_check(sb, out)
        cupy_prims.barrier(sb.buffer_ptrs, rank, sig, st, tag=3)
        sync(sb)
        ks.check_barrier_state(sb)
        return out
    finally:
        sb.destroy()


def cupy_local_read_write(world_size: int, shape: dict) -> list[dict]:
    """``world_size`` ranks as separate allocations on the current GPU: every rank pulls from and pushes into the
    next one with the CuPy kernels (stream order replaces the barriers); returns :func:`map_check` per rank."""
    sbs = SymmBuffer.local(world_size, **shape, device="cuda")
    try:
        outs = [base_info(sb) for sb in sbs]
        for sb in sbs:
            sb.x.view(torch.uint8)[:DEMO_ROWS].copy_(row_pattern(sb.rank, DEMO_ROWS, sb.layout.hidden).cuda())
        for sb, out in zip(sbs, outs):
            _cupy_copy_and_check(sb, sb.buffer_ptrs, (sb.rank + 1) % world_size, out)
        torch.cuda.synchronize()
        for sb, out in zip(sbs, outs):
            map_check(sb, out)
        return outs
    finally:
        for sb in sbs:
            sb.destroy()

