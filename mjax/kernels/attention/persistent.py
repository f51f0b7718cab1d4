"""How a persistent attention kernel deals its work items (tile, head, batch row) over its programs, one per SM:
program sm takes the items at places sm, 2S - 1 - sm, 2S + sm, ... of an order (a snake over rounds of S), so in a
run of items that get lighter each round's heaviest item goes to a different program. The forward and dq kernels
deal query tiles (under a causal mask the last is heaviest); the dk/dv kernel deals key tiles and reverses them,
tile -> n_tiles - 1 - tile, as its first key tile is the heaviest.

Two orders, both heads fastest (GQA siblings share K/V in L2):
- "row": one batch row after another (the programs running at once read one row's K/V; measured faster at long
  sequences), the last row's tiles heaviest (causal) first and the rows before it alternating;
- "tile": all rows' tiles together, heaviest first: the snake then keeps every program within one item of the
  mean for any shape.
`deal_order` takes "row" unless its deal leaves the busiest program clearly more work than "tile" would.
"""

import jax.numpy as jnp
import numpy as np

ORDERS = ("row", "tile")
ROW_ORDER_SLACK = 1.02  # how much more work the row order's busiest program may get than the tile order's


def persistent_works(sm, n_works: int, num_sms: int):
    """How many of n_works items program sm takes."""
    full, tail = divmod(n_works, num_sms)  # the last round holds `tail` items
    last = sm if full % 2 == 0 else num_sms - 1 - sm  # the program's place in that round
    return jnp.where(last < tail, full + 1, full)


def _item_at(w, n_heads: int, n_tiles: int, n_rows: int, order: str, where):
    """(tile, head, batch row) at place w (>= 0) of the order: in the kernel (traced scalars, jnp.where) and
    in program_loads (numpy arrays, np.where)."""
    if order == "row":
        row, rest = w // (n_heads * n_tiles), w % (n_heads * n_tiles)
        k = rest // n_heads  # the row's k-th tile in its order
        return where((n_rows - 1 - row) % 2 == 0, n_tiles - 1 - k, k), rest % n_heads, row
    k, rest = w // (n_heads * n_rows), w % (n_heads * n_rows)
    return n_tiles - 1 - k, rest % n_heads, rest // n_heads


def persistent_work(sm, i, num_sms: int, n_heads: int, n_tiles: int, n_rows: int, order: str):
    """(tile, head, batch row) of program sm's i-th item."""
    w = i * num_sms + jnp.where(i % 2 == 0, sm, num_sms - 1 - sm)
    return _item_at(w, n_heads, n_tiles, n_rows, order, jnp.where)


def program_loads(num_sms: int, n_heads: int, n_tiles: int, n_rows: int, order: str, causal: bool) -> np.ndarray:
    """[num_sms] the key blocks each program visits under the deal (a causal tile t: t + 1 blocks; else all equal)."""
    w = np.arange(n_heads * n_tiles * n_rows)
    rounds, pos = np.divmod(w, num_sms)
    program = np.where(rounds % 2 == 0, pos, num_sms - 1 - pos)  # who takes place w (persistent_work's inverse)
    tile, _, _ = _item_at(w, n_heads, n_tiles, n_rows, order, np.where)
    loads = np.zeros(num_sms)
    np.add.at(loads, program, tile + 1 if causal else 1)
    return loads


def deal_order(num_sms: int, n_heads: int, n_tiles: int, n_rows: int, causal: bool) -> str:
    """"row" unless its busiest program gets over ROW_ORDER_SLACK times the tile order's busiest program's work."""
    row, tile = (program_loads(num_sms, n_heads, n_tiles, n_rows, order, causal).max() for order in ORDERS)
    return "row" if row <= ROW_ORDER_SLACK * tile else "tile"
