#include <stdint.h>
#include <string.h>
#include <math.h>

/* The compiled replay of one what-if scenario (transforms/whatif/kernel.py builds and calls it).

   Same operations as the numpy replay in replay.py -- max over predecessors, + launch delay,
   max over comm-group members (and over the step's DP ranks when synchronised), + cost --
   in the same float64 arithmetic (no fused or reordered operations: -ffp-contract=off, no
   -ffast-math), so results are equal bit for bit. Lanes are replayed `block` steps at a time:
   each row of `starts` / `ends` holds the block's lanes, so every inner loop is a contiguous,
   vectorisable pass, and the block stays in cache.

   Scenario values come as (base, alt, where) arrays, C-contiguous, each dimension either 1 or
   the full [n_ops, n_lanes] one (dims: rows, cols of cost base, alt, where, delay base, alt,
   where): the value of op o in lane l is alt[o, l] where where[o, l], else base[o, l]. */

#define ROW(array, rows, cols, op) ((array) + ((rows) > 1 ? (op) : 0) * (cols))

/* out[j] = in[j] + the value of op `op` in lane first_lane + j, for j < w (out may be in); when
   `high` is not NULL, also high[j] = max(high[j], out[j]). */
static void add_values(double *out, const double *in, double *restrict high, int64_t op, int64_t first_lane,
                       int64_t w, const double *base, int64_t base_rows, int64_t base_cols,
                       const double *alt, int64_t alt_rows, int64_t alt_cols,
                       const uint8_t *where, int64_t where_rows, int64_t where_cols)
{
    const uint8_t *choice = ROW(where, where_rows, where_cols, op);
    const double *base_row = ROW(base, base_rows, base_cols, op), *alt_row = ROW(alt, alt_rows, alt_cols, op);
    if (where_cols == 1) {                                      /* one source for the whole row */
        const double *values = choice[0] ? alt_row : base_row;
        if ((choice[0] ? alt_cols : base_cols) == 1) {
            double value = values[0];
            for (int64_t j = 0; j < w; j++) out[j] = in[j] + value;
        } else {
            values += first_lane;
            for (int64_t j = 0; j < w; j++) out[j] = in[j] + values[j];
        }
    } else {                                                    /* a source per lane: one loop per kind of row */
        choice += first_lane;
        if (base_cols > 1 && alt_cols > 1) {
            const double *b = base_row + first_lane, *a = alt_row + first_lane;
            for (int64_t j = 0; j < w; j++) out[j] = in[j] + (choice[j] ? a[j] : b[j]);
        } else if (base_cols > 1) {
            const double *b = base_row + first_lane, a = alt_row[0];
            for (int64_t j = 0; j < w; j++) out[j] = in[j] + (choice[j] ? a : b[j]);
        } else if (alt_cols > 1) {
            const double b = base_row[0], *a = alt_row + first_lane;
            for (int64_t j = 0; j < w; j++) out[j] = in[j] + (choice[j] ? a[j] : b);
        } else {
            const double b = base_row[0], a = alt_row[0];
            for (int64_t j = 0; j < w; j++) out[j] = in[j] + (choice[j] ? a : b);
        }
    }
    if (high)
        for (int64_t j = 0; j < w; j++) high[j] = out[j] > high[j] ? out[j] : high[j];
}

/* Replay one scenario over n_steps x dp lanes: step_time / step_span per step, and the full
   starts / ends ([n_ops, n_steps * dp]) when starts_out and ends_out are not NULL.
   workspace: (2 * n_ops + 5) * block * dp doubles of scratch, the caller's to reuse from one
   scenario to the next (fresh memory for every scenario costs a page fault per 4 KiB, as
   much time as the replay itself on a trace the size of AR). */
void strag_replay(int64_t n_ops, const int64_t *pred_ptr, const int64_t *pred_index,
                 int64_t n_levels, const int64_t *bounds, const int64_t *group_end,
                 const uint8_t *synced, const uint8_t *optimizer,
                 int64_t n_steps, int64_t dp, int64_t block,
                 const double *cost_base, const double *cost_alt, const uint8_t *cost_where,
                 const double *delay_base, const double *delay_alt, const uint8_t *delay_where,
                 const int64_t *dims, int has_delay, double *workspace,
                 double *starts_out, double *ends_out, double *step_time, double *step_span)
{
    int64_t width = block * dp, n_lanes = n_steps * dp;
    double *ends = workspace, *starts = workspace + (n_ops + 1) * width, *work = starts + n_ops * width;
    double *restrict latest = work, *restrict low = work + width, *restrict high = work + 2 * width;
    double *restrict top = work + 3 * width;
    for (int64_t first_step = 0; first_step < n_steps; first_step += block) {
        int64_t nb = n_steps - first_step < block ? n_steps - first_step : block;
        int64_t w = nb * dp, first_lane = first_step * dp;
        double *restrict zero = ends + n_ops * width;
        for (int64_t j = 0; j < w; j++) { zero[j] = 0.0; low[j] = INFINITY; high[j] = -INFINITY; top[j] = -INFINITY; }
        for (int64_t level = 0; level < n_levels; level++) {
            int64_t lo = bounds[level], hi = bounds[level + 1];
            for (int64_t op = lo; op < hi; op++) {               /* starts: max over predecessors (+ delay) */
                double *restrict row = starts + op * width;
                const double *restrict source = ends + pred_index[pred_ptr[op]] * width;
                int64_t k = pred_ptr[op] + 1;
                if (k < pred_ptr[op + 1]) {                       /* the first two predecessors in one pass */
                    const double *restrict second = ends + pred_index[k++] * width;
                    for (int64_t j = 0; j < w; j++) row[j] = second[j] > source[j] ? second[j] : source[j];
                } else {
                    for (int64_t j = 0; j < w; j++) row[j] = source[j];
                }
                for (; k < pred_ptr[op + 1]; k++) {
                    source = ends + pred_index[k] * width;
                    for (int64_t j = 0; j < w; j++) row[j] = source[j] > row[j] ? source[j] : row[j];
                }
                if (has_delay)
                    add_values(row, row, NULL, op, first_lane, w, delay_base, dims[6], dims[7], delay_alt, dims[8],
                               dims[9], delay_where, dims[10], dims[11]);
                for (int64_t j = 0; j < w; j++) low[j] = row[j] < low[j] ? row[j] : low[j];
            }
            for (int64_t op = lo; op < hi; op = group_end[op]) {  /* ends, one group (or own op) at a time */
                int64_t stop = group_end[op];
                const double *restrict first = starts + op * width;
                if (stop == op + 1 && !synced[op]) {               /* an op on its own: end = start + cost */
                    double *restrict out = ends + op * width;
                    add_values(out, first, high, op, first_lane, w, cost_base, dims[0], dims[1], cost_alt, dims[2],
                               dims[3], cost_where, dims[4], dims[5]);
                    if (optimizer[op])
                        for (int64_t j = 0; j < w; j++) top[j] = out[j] > top[j] ? out[j] : top[j];
                    continue;
                }
                for (int64_t j = 0; j < w; j++) latest[j] = first[j];
                for (int64_t member = op + 1; member < stop; member++) {
                    const double *restrict row = starts + member * width;
                    for (int64_t j = 0; j < w; j++) latest[j] = row[j] > latest[j] ? row[j] : latest[j];
                }
                if (synced[op]) {                                  /* DP synchronisation: max over each step's ranks */
                    for (int64_t s = 0; s < nb; s++) {
                        double most = latest[s * dp];
                        for (int64_t d = 1; d < dp; d++) most = latest[s * dp + d] > most ? latest[s * dp + d] : most;
                        for (int64_t d = 0; d < dp; d++) latest[s * dp + d] = most;
                    }
                }
                for (int64_t member = op; member < stop; member++) {
                    double *restrict out = ends + member * width;
                    add_values(out, latest, high, member, first_lane, w, cost_base, dims[0], dims[1], cost_alt, dims[2],
                               dims[3], cost_where, dims[4], dims[5]);
                    if (optimizer[member])
                        for (int64_t j = 0; j < w; j++) top[j] = out[j] > top[j] ? out[j] : top[j];
                }
            }
        }
        for (int64_t s = 0; s < nb; s++) {
            double earliest = INFINITY, last = -INFINITY, optimizer_end = -INFINITY;
            for (int64_t d = 0; d < dp; d++) {
                int64_t j = s * dp + d;
                earliest = low[j] < earliest ? low[j] : earliest;
                last = high[j] > last ? high[j] : last;
                optimizer_end = top[j] > optimizer_end ? top[j] : optimizer_end;
            }
            step_time[first_step + s] = optimizer_end;
            step_span[first_step + s] = last - earliest;
        }
        if (starts_out && ends_out)
            for (int64_t op = 0; op < n_ops; op++) {
                memcpy(starts_out + op * n_lanes + first_lane, starts + op * width, sizeof(double) * w);
                memcpy(ends_out + op * n_lanes + first_lane, ends + op * width, sizeof(double) * w);
            }
    }
}
