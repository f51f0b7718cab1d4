"""How a persistent attention kernel deals its work items (tile, head, batch row) over its programs, one per SM:
program sm takes the items at places sm, 2S - 1 - sm, 2S + sm, ... of an order (a snake over rounds of S), so in a
run of items that get lighter each round's heaviest item goes to a different program.

The order is computed at run time from the block runs (`deal`): the (batch row, tile) pairs sorted by the
blocks their items visit, heaviest first, each pair's items heads fastest (GQA siblings share K/V in L2). Causal
tiles without segment ids get heavier one way (the last query tile, the first key tile), so that is their order;
with segment ids (packed documents) the sort follows the documents. Two groupings:
- "row": one batch row after another (the programs running at once read one row's K/V; measured faster at long
  sequences), the last row heaviest first and the rows before it alternating;
- "tile": all rows together, heaviest first: the snake then keeps every program within one item of the mean for
  any shape and any work.
`deal_order` takes "row" unless its deal of causal work leaves the busiest program clearly more work than "tile"
would. With segment ids the work is known only at run time: the same rule then picks on the block runs ("work").
"""

import jax.numpy as jnp
import numpy as np
from jax import lax

from mjax.kernels.attention.mosaic_common import union_of_runs

ORDERS = ("row", "tile")
ROW_ORDER_SLACK = 1.02  # how much more work the row order's busiest program may get than the tile order's


def persistent_works(sm, n_works: int, num_sms: int):
    """How many of n_works items program sm takes."""
    full, tail = divmod(n_works, num_sms)  # the last round holds `tail` items
    last = sm if full % 2 == 0 else num_sms - 1 - sm  # the program's place in that round
    return jnp.where(last < tail, full + 1, full)


def item_works(runs):
    """[B, n] int32: the blocks each item streams, the union of its two tiles' runs (block_runs' [B, 2n, 4]; the
    kernels' union_range)."""
    lo, hi = union_of_runs(runs[:, 0::2, 0], runs[:, 0::2, 3], runs[:, 1::2, 0], runs[:, 1::2, 3])
    return hi - lo


def deal_pairs(work, order: str, xp=jnp):
    """[B * n] int32: the (batch row, tile) pairs, as row * n + tile, in the order their items are dealt, of their
    work [B, n] (xp: jnp in the kernels' wrapper, np in the model below). Heaviest first, equal work the later
    pair first."""
    if order not in ORDERS:
        raise ValueError(f"deal order {order!r}: must be one of {ORDERS}")
    b, n = work.shape
    if order == "row":
        lightest_first = xp.argsort(work, axis=1, stable=True)  # [B, n]
        heaviest_first = (b - 1 - xp.arange(b)) % 2 == 0  # the last row, and every other row before it
        tiles = xp.where(heaviest_first[:, None], lightest_first[:, ::-1], lightest_first)
        return (xp.arange(b)[:, None] * n + tiles).reshape(-1).astype(xp.int32)
    return xp.argsort(work.reshape(-1), stable=True)[::-1].astype(xp.int32)


def persistent_work(sm, i, num_sms: int, n_heads: int, n_tiles: int, deal_ref):
    """(tile, head, batch row) of program sm's i-th item; deal_ref: deal_pairs' order."""
    w = i * num_sms + jnp.where(i % 2 == 0, sm, num_sms - 1 - sm)
    pair = deal_ref[lax.div(w, jnp.int32(n_heads))]
    return lax.rem(pair, jnp.int32(n_tiles)), lax.rem(w, jnp.int32(n_heads)), lax.div(pair, jnp.int32(n_tiles))


def program_loads(work, n_heads: int, num_sms: int, order: str, xp=np):
    """[num_sms] the blocks each program streams when the items of work [B, n] (per (row, tile) pair, each of its
    n_heads items alike) are dealt in `order` (xp: np for the static model, jnp at run time)."""
    return _loads(work, deal_pairs(work, order, xp), n_heads, num_sms, xp)


def _loads(work, pairs, n_heads: int, num_sms: int, xp):
    b, n = work.shape
    w = xp.arange(n_heads * n * b)
    rounds, pos = w // num_sms, w % num_sms
    program = xp.where(rounds % 2 == 0, pos, num_sms - 1 - pos)  # who takes place w (persistent_work's inverse)
    item_work = work.reshape(-1)[pairs][w // n_heads]
    if xp is np:
        loads = np.zeros(num_sms)
        np.add.at(loads, program, item_work)
        return loads
    return jnp.zeros(num_sms, work.dtype).at[program].add(item_work)


def modelled_work(n_tiles: int, n_rows: int, causal: bool) -> np.ndarray:
    """[n_rows, n_tiles] the static model's work: query tile t visits t + 1 blocks (causal), or all alike."""
    return np.broadcast_to(np.arange(1, n_tiles + 1) if causal else np.ones(n_tiles, int), (n_rows, n_tiles))


def _row_order_is_even(loads_row, loads_tile):
    return loads_row.max() <= ROW_ORDER_SLACK * loads_tile.max()


def deal_order(num_sms: int, n_heads: int, n_tiles: int, n_rows: int, causal: bool, segments: bool) -> str:
    """"row" unless its busiest program gets over ROW_ORDER_SLACK times the tile order's busiest program's
    (modelled) causal work; "work" with segment ids: the same choice at run time, on the block runs."""
    if segments:
        return "work"
    work = modelled_work(n_tiles, n_rows, causal)
    return "row" if _row_order_is_even(*(program_loads(work, n_heads, num_sms, o) for o in ORDERS)) else "tile"


def deal(runs, n_heads: int, num_sms: int, order: str):
    """[B * n] int32, what persistent_work reads: deal_pairs of the block runs [B, 2n, 4] in `order`, or for
    "work" in the order deal_order's rule picks on these runs."""
    work = item_works(runs)
    if order != "work":
        return deal_pairs(work, order)
    row, tile = (deal_pairs(work, o) for o in ORDERS)
    pick_row = _row_order_is_even(*(_loads(work, pairs, n_heads, num_sms, jnp) for pairs in (row, tile)))
    return jnp.where(pick_row, row, tile)
