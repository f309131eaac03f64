#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

/* The engine's compiled functions (transforms/whatif/kernel.py builds this file and calls them):
   strag_replay, the replay of one what-if scenario; strag_repack, greedy document repacking
   for the sequence-imbalance fix; strag_covered and strag_group_order for the untraced-time
   measurement. Each has an exactly equal numpy / Python fallback. */

/* strag_replay: same operations as the numpy replay in replay.py -- max over predecessors, +
   launch delay, max over comm-group members (and over the step's DP ranks when synchronised),
   + cost -- in the same float64 arithmetic (no fused or reordered operations:
   -ffp-contract=off, no -ffast-math), so results are equal bit for bit. Lanes are replayed
   `block` steps at a time: each row of `starts` / `ends` holds the block's lanes, so every
   inner loop is a contiguous, vectorisable pass, and the block stays in cache.

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
   much time as the replay itself on a trace the size of AR).
   track[op]: bit 1, its starts count toward the earliest start of the step; bit 2, its ends
   toward the latest end. Every op in general; with no negative cost or delay, the sources and
   the sinks suffice (an op starts no earlier than its predecessors end, and ends no earlier than
   it starts: min and max are exact), two passes per op fewer. */
void strag_replay(int64_t n_ops, const int64_t *pred_ptr, const int64_t *pred_index,
                 int64_t n_levels, const int64_t *bounds, const int64_t *group_end,
                 const uint8_t *synced, const uint8_t *optimizer, const uint8_t *track,
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
                if (track[op] & 1)
                    for (int64_t j = 0; j < w; j++) low[j] = row[j] < low[j] ? row[j] : low[j];
            }
            for (int64_t op = lo; op < hi; op = group_end[op]) {  /* ends, one group (or own op) at a time */
                int64_t stop = group_end[op];
                const double *restrict first = starts + op * width;
                if (stop == op + 1 && !synced[op]) {               /* an op on its own: end = start + cost */
                    double *restrict out = ends + op * width;
                    add_values(out, first, track[op] & 2 ? high : NULL, op, first_lane, w, cost_base, dims[0], dims[1], cost_alt, dims[2],
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
                    add_values(out, latest, track[member] & 2 ? high : NULL, member, first_lane, w, cost_base, dims[0], dims[1], cost_alt, dims[2],
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


/* strag_repack: one-at-a-time greedy repacking of every step's documents (causes/sequences.py
   has the same rule in Python, `_repack_python`; both give identical results).

   A step's documents come longest first; each goes to the lightest bin (load: sum of squared
   lengths; ties: lowest index) whose room (capacity - tokens already in it) holds it, and to
   the lightest bin overall when none does. The bins not known to lack room are eligible: a
   tournament tree over the bins (each node the lighter of its two children; a bin not
   eligible weighs +inf) has the lightest at its root, and a bin's new load climbs a fixed
   path (a binary heap's sift-down must compare before it knows where to read next: 2x
   slower here). A bin without room for the next length goes `aside` (when it takes a
   document, or when it surfaces at the root), a binary heap, most room first, which returns
   bins as soon as the current, shorter, length fits. Only the overflow (no bin has room:
   rare) fills a bin that is aside; it pushes the bin's new room and leaves the old entry
   stale (its room is no longer the bin's, and larger: popped first, then dropped), and scans
   for the lightest bin. O(log bins) per document, O(bins) per overflow: ~30 ns a document
   with 3,000 bins. */

typedef struct { double key; int64_t bin; } Entry;

/* A key's bits: for keys >= 0 (loads, +inf) their integer order is the numeric order. */
static inline uint64_t bits(double key) { uint64_t out; memcpy(&out, &key, sizeof out); return out; }

/* The tournament tree of one step: nodes 1 .. 2 leaves - 1, bin b at leaf leaves + b, each
   node the (key bits, bin) of the lighter child (of equal keys, the lower bin). */
typedef struct { uint64_t *key; int64_t *bin; int64_t leaves; } Tree;

/* Bin b now weighs `key`: climb to the root. Of equal keys the left child's wins (its bins
   have the lower indices): the climbing entry, when a right child, yields to a left sibling
   no heavier, one integer comparison against its key + 1. Selected with masks, not branches:
   which sibling wins is unpredictable. */
static void update(Tree tree, int64_t b, double key)
{
    uint64_t climbing = bits(key);
    int64_t who = b, node = tree.leaves + b;
    tree.key[node] = climbing;
    tree.bin[node] = who;
    for (; node > 1; node >>= 1) {
        uint64_t other = tree.key[node ^ 1];
        int64_t other_bin = tree.bin[node ^ 1];
        uint64_t take = -(uint64_t)(other < climbing + (uint64_t)(node & 1));
        climbing = (other & take) | (climbing & ~take);
        who = (int64_t)(((uint64_t)other_bin & take) | ((uint64_t)who & ~take));
        tree.key[node >> 1] = climbing;
        tree.bin[node >> 1] = who;
    }
}

/* Every bin eligible, weighing load[b] (the padding leaves never eligible). */
static void plant(Tree tree, int64_t bins, const double *load)
{
    for (int64_t b = 0; b < tree.leaves; b++) {
        tree.key[tree.leaves + b] = bits(b < bins ? load[b] : INFINITY);
        tree.bin[tree.leaves + b] = b;
    }
    for (int64_t node = tree.leaves - 1; node >= 1; node--) {
        int64_t child = 2 * node + (tree.key[2 * node + 1] < tree.key[2 * node]);
        tree.key[node] = tree.key[child];
        tree.bin[node] = tree.bin[child];
    }
}

/* aside order: more room first (ties in any order: they move together) */
static void push_room(Entry *heap, int64_t *size, Entry entry)
{
    int64_t i = (*size)++;
    while (i > 0 && entry.key > heap[(i - 1) / 2].key) {
        heap[i] = heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    heap[i] = entry;
}

static void pop_room(Entry *heap, int64_t *size)
{
    Entry last = heap[--*size];
    int64_t i = 0, child;
    while ((child = 2 * i + 1) < *size) {
        if (child + 1 < *size && heap[child + 1].key > heap[child].key) child++;
        if (!(heap[child].key > last.key)) break;
        heap[i] = heap[child];
        i = child;
    }
    heap[i] = last;
}

/* A document length the rule accepts: finite, >= 0, no longer than the one before. */
static inline int in_order(double length, double previous)
{
    return length >= 0.0 && length <= previous && isfinite(length);
}

/* Steps repacked side by side: each document's climb is a chain of dependent comparisons,
   and two independent chains keep the CPU busier than one (~15% faster; more do not help). */
#define LANES 2

/* One step's repacking in progress. */
typedef struct {
    const double *lengths;
    int64_t n_docs, doc, bins, n_aside;
    double previous;
    Tree tree;
    double *room, *load;
    Entry *aside;
    int64_t *target;
} Step;

/* Start a step: empty bins, the first round (it needs no tree: while the documents fit an
   empty bin and make it heavier than empty, the next empty bin is the lightest one with the
   lowest index), then the tree. Returns 0, or -2 when a length is not in_order or there are
   documents and no bin. */
static int start(Step *st, double capacity)
{
    const double *lengths = st->lengths;
    st->doc = st->n_aside = 0;
    st->previous = INFINITY;
    if (st->n_docs && st->bins < 1) return -2;
    for (int64_t b = 0; b < st->bins; b++) { st->load[b] = 0.0; st->room[b] = capacity; }
    for (; st->doc < st->n_docs && st->doc < st->bins && lengths[0] <= capacity
           && lengths[st->doc] * lengths[st->doc] > 0.0; st->doc++) {
        if (!in_order(lengths[st->doc], st->previous)) return -2;
        st->previous = lengths[st->doc];
        st->load[st->doc] = st->previous * st->previous;
        st->room[st->doc] -= st->previous;
        st->target[st->doc] = st->doc;
    }
    plant(st->tree, st->bins, st->load);
    return 0;
}

/* The step's next document; 0, or -2 when its length is not in_order. */
static inline int place(Step *st)
{
    Tree tree = st->tree;
    double *room = st->room, *load = st->load;
    Entry *aside = st->aside;
    int64_t doc = st->doc++;
    double length = st->lengths[doc];
    if (!in_order(length, st->previous)) return -2;
    st->previous = length;
    while (st->n_aside && aside[0].key >= length) {   /* room again: back unless stale */
        int64_t b = aside[0].bin;
        if (aside[0].key == room[b]) update(tree, b, load[b]);
        pop_room(aside, &st->n_aside);
    }
    while (tree.key[1] != bits(INFINITY) && room[tree.bin[1]] < length) {
        int64_t b = tree.bin[1];
        push_room(aside, &st->n_aside, (Entry){room[b], b});
        update(tree, b, INFINITY);
    }
    int eligible = tree.key[1] != bits(INFINITY);
    int64_t b = tree.bin[1];
    if (!eligible)                                 /* no room anywhere: the lightest bin */
        for (int64_t other = b = 0; other < st->bins; other++)
            b = load[other] < load[b] ? other : b;
    double before = room[b];
    load[b] += length * length;
    room[b] -= length;
    st->target[doc] = b;
    if (!eligible) {
        if (room[b] != before) push_room(aside, &st->n_aside, (Entry){room[b], b});
    } else if (doc + 1 < st->n_docs && room[b] < st->lengths[doc + 1]) {   /* no room for the next one */
        push_room(aside, &st->n_aside, (Entry){room[b], b});
        update(tree, b, INFINITY);
    } else {
        update(tree, b, load[b]);
    }
    return 0;
}

/* Steps s < n_steps: documents doc_ptr[s] .. doc_ptr[s + 1] of `lengths` (non-increasing,
   finite, >= 0), bins bin_ptr[s] .. bin_ptr[s + 1] of `loads`, capacity[s] tokens per bin.
   Writes every document's bin (0-based within its step) to `target` and the bins' loads.
   Returns 0, -1 when memory cannot be allocated, or -2 when a step's input is invalid. */
int strag_repack(int64_t n_steps, const int64_t *doc_ptr, const double *lengths, const int64_t *bin_ptr,
                 const double *capacity, int64_t *target, double *loads)
{
    int64_t most_bins = 1, most_docs = 1, leaves = 1, next = 0;
    int status = 0;
    for (int64_t s = 0; s < n_steps; s++) {
        most_bins = bin_ptr[s + 1] - bin_ptr[s] > most_bins ? bin_ptr[s + 1] - bin_ptr[s] : most_bins;
        most_docs = doc_ptr[s + 1] - doc_ptr[s] > most_docs ? doc_ptr[s + 1] - doc_ptr[s] : most_docs;
    }
    while (leaves < most_bins) leaves *= 2;
    Step lane[LANES];
    for (int k = 0; k < LANES; k++) {
        lane[k] = (Step){.tree = {malloc(sizeof(uint64_t) * 2 * leaves), malloc(sizeof(int64_t) * 2 * leaves), leaves},
                         .room = malloc(sizeof(double) * most_bins), .aside = malloc(sizeof(Entry) * (most_bins + most_docs))};
        if (!lane[k].tree.key || !lane[k].tree.bin || !lane[k].room || !lane[k].aside) status = -1;
    }
    for (int busy = 1; busy && !status;) {
        busy = 0;
        for (int k = 0; k < LANES && !status; k++) {
            Step *st = lane + k;
            for (; st->doc == st->n_docs && next < n_steps && !status; next++) {    /* idle: the next step */
                st->lengths = lengths + doc_ptr[next];
                st->n_docs = doc_ptr[next + 1] - doc_ptr[next];
                st->bins = bin_ptr[next + 1] - bin_ptr[next];
                st->target = target + doc_ptr[next];
                st->load = loads + bin_ptr[next];
                status = start(st, capacity[next]);
            }
            if (st->doc < st->n_docs && !status) {
                status = place(st);
                busy = 1;
            }
        }
    }
    for (int k = 0; k < LANES; k++) { free(lane[k].tree.key); free(lane[k].tree.bin); free(lane[k].room); free(lane[k].aside); }
    return status;
}

/* strag_covered: per gap, the time inside [min(start, end), end] that the busy spans of its own
   timeline cover (overlapping spans count once) -- transforms/intervals.py covered_grouped, whose
   floats it reproduces: each timeline's spans in (start, position) order, merged into runs while
   the running maximum of their ends reaches the next start, each run's busy time before it summed
   in run order, then per gap busy_before(end) - busy_before(start), at least 0.
   Timelines are integers in [0, n_groups); no value may be NaN (the caller checks). Returns 0, or
   -1 when memory cannot be had. */

static void sort_by_start(int64_t *idx, int64_t *tmp, int64_t m, const double *start)
{
    /* stable: insertion sort of 32-blocks, then merges (skipped where two blocks are in order) */
    for (int64_t lo = 0; lo < m; lo += 32) {
        int64_t hi = lo + 32 < m ? lo + 32 : m;
        for (int64_t k = lo + 1; k < hi; k++) {
            int64_t v = idx[k], j = k;
            while (j > lo && start[idx[j - 1]] > start[v]) { idx[j] = idx[j - 1]; j--; }
            idx[j] = v;
        }
    }
    for (int64_t width = 32; width < m; width *= 2) {
        for (int64_t lo = 0; lo + width < m; lo += 2 * width) {
            int64_t mid = lo + width, hi = lo + 2 * width < m ? lo + 2 * width : m;
            if (!(start[idx[mid - 1]] > start[idx[mid]]))
                continue;
            memcpy(tmp, idx + lo, (size_t)width * sizeof *idx);
            int64_t a = 0, b = mid, k = lo;
            while (a < width && b < hi)
                idx[k++] = start[idx[b]] < start[tmp[a]] ? idx[b++] : tmp[a++];
            while (a < width)
                idx[k++] = tmp[a++];
        }
    }
}

static double busy_before(double t, const double *lo, const double *hi, const double *before, int64_t n)
{
    int64_t a = 0, b = n;                      /* runs starting at or before t: lo[0..a) */
    while (a < b) {
        int64_t mid = a + (b - a) / 2;
        if (lo[mid] <= t) a = mid + 1; else b = mid;
    }
    if (a == 0)
        return 0.0;
    int64_t k = a - 1;
    double x = t - lo[k], length = hi[k] - lo[k];
    x = x < 0.0 ? 0.0 : x;
    x = x > length ? length : x;
    return before[k] + x;
}

/* order[] = the n positions by (group, value, position); ptr[0..n_groups] = where each group's
   positions begin in it (ptr[n_groups] = n). tmp: scratch of n. */
static void order_by_group(int64_t n_groups, int64_t n, const int64_t *group, const double *value,
                           int64_t *order, int64_t *ptr, int64_t *tmp)
{
    for (int64_t i = 0; i < n; i++)
        ptr[group[i] + 1]++;
    for (int64_t g = 0; g < n_groups; g++)
        ptr[g + 1] += ptr[g];
    for (int64_t i = 0; i < n; i++)           /* by group, keeping positions in order */
        order[ptr[group[i]]++] = i;
    for (int64_t g = n_groups; g > 0; g--)    /* ptr[g] was the end of group g: shift back to starts */
        ptr[g] = ptr[g - 1];
    ptr[0] = 0;
    for (int64_t g = 0; g < n_groups; g++)
        sort_by_start(order + ptr[g], tmp, ptr[g + 1] - ptr[g], value);
}

int strag_covered(int64_t n_groups, int64_t n_busy, const int64_t *busy_group, const double *busy_start,
                  const double *busy_end, int64_t n_gaps, const int64_t *gap_group, const double *gap_start,
                  const double *gap_end, double *out)
{
    int64_t *ptr = calloc((size_t)n_groups + 1, sizeof *ptr), *run_ptr = calloc((size_t)n_groups + 1, sizeof *ptr);
    int64_t *idx = malloc(((size_t)n_busy + 1) * sizeof *idx), *tmp = malloc(((size_t)n_busy + 1) * sizeof *tmp);
    double *lo = malloc(((size_t)n_busy + 1) * sizeof *lo), *hi = malloc(((size_t)n_busy + 1) * sizeof *hi);
    double *before = malloc(((size_t)n_busy + 1) * sizeof *before);
    int status = -1;
    if (!ptr || !run_ptr || !idx || !tmp || !lo || !hi || !before)
        goto done;
    order_by_group(n_groups, n_busy, busy_group, busy_start, idx, ptr, tmp);   /* each timeline by start */
    int64_t runs = 0;
    for (int64_t g = 0; g < n_groups; g++) {
        int64_t first = ptr[g], m = ptr[g + 1] - first;
        run_ptr[g] = runs;
        if (m == 0)
            continue;
        double reach = busy_end[idx[first]], sum = 0.0;
        lo[runs] = busy_start[idx[first]];
        for (int64_t k = 1; k < m; k++) {
            int64_t i = idx[first + k];
            if (busy_start[i] > reach) {       /* a new run: close the last one */
                hi[runs] = reach;
                before[runs] = sum;
                sum += reach - lo[runs];
                lo[++runs] = busy_start[i];
            }
            if (busy_end[i] > reach)
                reach = busy_end[i];
        }
        hi[runs] = reach;
        before[runs] = sum;
        runs++;
    }
    run_ptr[n_groups] = runs;
    for (int64_t i = 0; i < n_gaps; i++) {
        int64_t g = gap_group[i], first = run_ptr[g], n = run_ptr[g + 1] - first;
        double end = gap_end[i], begin = gap_start[i] < end ? gap_start[i] : end;
        double d = busy_before(end, lo + first, hi + first, before + first, n)
                   - busy_before(begin, lo + first, hi + first, before + first, n);
        out[i] = d > 0.0 ? d : 0.0;
    }
    status = 0;
done:
    free(ptr); free(run_ptr); free(idx); free(tmp); free(lo); free(hi); free(before);
    return status;
}

/* strag_group_order: the positions of n values ordered by (group, value, position), as numpy's
   stable np.lexsort((value, group)); groups in [0, n_groups), no NaN value (the caller checks).
   Returns 0, or -1 when memory cannot be had. */
int strag_group_order(int64_t n_groups, int64_t n, const int64_t *group, const double *value, int64_t *order)
{
    int64_t *ptr = calloc((size_t)n_groups + 1, sizeof *ptr), *tmp = malloc(((size_t)n + 1) * sizeof *tmp);
    int status = -1;
    if (ptr && tmp) {
        order_by_group(n_groups, n, group, value, order, ptr, tmp);
        status = 0;
    }
    free(ptr); free(tmp);
    return status;
}
