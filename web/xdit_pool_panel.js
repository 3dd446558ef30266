// The xDiT pool panel: every pool the server knows (GET /xdit/pools) drawn as its
// dp × cfg × pp × sp(ring × ulysses) mesh, one cell per rank, with state, live step and memory per rank,
// and Stop / Restart buttons. Kept live by the server's `xdit.pool.step` / `xdit.pool.update` events, a
// refresh when a prompt ends, and a light poll while the tab is open.
//
// ComfyUI imports every .js file of the pack's web folder; this one only exports, xdit_pool.js uses it.
import { api } from "../../scripts/api.js";

const POLL_MS = 2000;
const CELL_WIDTH = "minmax(38px, 54px)";
const AXES = ["dp", "cfg", "pp", "ring", "ulysses"];
const DEGREE_KEYS = {
  dp: "dp_degree", cfg: "cfg_degree", pp: "pipefusion_degree", ring: "ring_degree", ulysses: "ulysses_degree",
};

const PANEL_CSS = `
.xdit-panel { padding: 10px; box-sizing: border-box; font-size: 13px;
  color: var(--fg-color, #ddd); display: flex; flex-direction: column; gap: 10px; }
.xdit-panel h3 { margin: 0; font-size: 15px; font-weight: 600; display: flex; justify-content: space-between;
  align-items: center; }
.xdit-panel .xdit-hint { color: var(--descrip-text, #999); font-size: 12px; }
.xdit-panel .xdit-fetch-error { color: #ff6b6b; font-size: 12px; }
.xdit-pool { border: 1px solid var(--border-color, #444); border-radius: 8px; padding: 10px;
  background: var(--comfy-input-bg, #222); display: flex; flex-direction: column; gap: 8px; }
.xdit-pool-head { display: flex; align-items: center; gap: 8px; }
.xdit-pool-title { font-weight: 600; overflow-wrap: anywhere; flex: 1; }
.xdit-state { border-radius: 10px; padding: 1px 8px; font-size: 11px; font-weight: 600; color: #111;
  text-transform: uppercase; }
.xdit-pipeline { overflow-wrap: anywhere; }
.xdit-chips { display: flex; flex-wrap: wrap; gap: 4px; }
.xdit-chip { font-size: 11px; padding: 1px 6px; border-radius: 4px; background: var(--comfy-menu-bg, #333);
  color: var(--descrip-text, #aaa); }
.xdit-chip b { color: var(--fg-color, #ddd); font-weight: 600; }
.xdit-mesh { display: flex; flex-wrap: wrap; gap: 8px; }
.xdit-mesh-group { border: 1px dashed var(--border-color, #555); border-radius: 6px; padding: 6px; }
.xdit-mesh-label { font-size: 11px; color: var(--descrip-text, #999); margin-bottom: 4px; }
.xdit-mesh-grid { display: grid; gap: 4px; }
.xdit-rank { height: 40px; border-radius: 5px; display: flex; flex-direction: column;
  align-items: center; justify-content: center; color: #111; line-height: 1.2; }
.xdit-rank-id { font-weight: 700; font-size: 12px; }
.xdit-rank-step { font-size: 11px; font-variant-numeric: tabular-nums; }
.xdit-axes { font-size: 11px; color: var(--descrip-text, #999); }
.xdit-memory, .xdit-layout-auto { border-collapse: collapse; font-size: 12px; width: 100%; font-variant-numeric: tabular-nums; }
.xdit-memory caption, .xdit-layout-auto caption { text-align: left; font-size: 11px; color: var(--descrip-text, #999); padding-bottom: 2px; }
.xdit-memory th, .xdit-layout-auto th { color: var(--descrip-text, #999); font-weight: 500; text-align: right; padding: 1px 6px; }
.xdit-memory td, .xdit-layout-auto td { text-align: right; padding: 1px 6px; border-top: 1px solid var(--border-color, #333); }
.xdit-memory th:first-child, .xdit-memory td:first-child,
.xdit-layout-auto th:first-child, .xdit-layout-auto td:first-child { text-align: left; }
.xdit-layout-auto { margin-bottom: 6px; }
.xdit-layout-auto tr[data-chosen="true"] td { font-weight: 600; }
.xdit-actions { display: flex; gap: 6px; }
.xdit-actions button { flex: 1; padding: 4px 8px; border-radius: 5px; cursor: pointer; font-size: 12px;
  border: 1px solid var(--border-color, #555); background: var(--comfy-menu-bg, #333); color: var(--fg-color, #ddd); }
.xdit-actions button:hover:not(:disabled) { filter: brightness(1.3); }
.xdit-actions button:disabled { opacity: 0.5; cursor: default; }
.xdit-pool-error { color: #ff6b6b; font-size: 12px; overflow-wrap: anywhere; }
`;

const STATE_COLOURS = {
  idle: "#4cc38a", busy: "#4d9fff", starting: "#f0b429", error: "#ff6b6b", stopped: "#8b949e", unreachable: "#b07cff",
};

function h(tag, attributes = {}, ...children) {
  const element = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "dataset") Object.assign(element.dataset, value);
    else if (key === "style") Object.assign(element.style, value);
    else if (key.startsWith("on")) element.addEventListener(key.slice(2), value);
    else element[key] = value;
  }
  element.append(...children.flat(Infinity).filter((child) => child != null));
  return element;
}

const megabytes = (bytes) => (bytes == null ? "–" : (bytes / 1e6).toFixed(bytes < 1e7 ? 1 : 0));

/** Mesh coordinates per rank: the server's, else laid out from the degrees (dp outermost, ulysses innermost). */
function meshOf(pool) {
  if (Array.isArray(pool.status?.mesh) && pool.status.mesh.length) return pool.status.mesh;
  const parallel = pool.status?.parallel ?? pool.key?.parallel ?? {};
  const shape = AXES.map((axis) => Number(parallel[DEGREE_KEYS[axis]]) || 1);
  const size = Math.max(1, pool.status?.world_size ?? pool.key?.nproc ?? 1);
  return Array.from({ length: size }, (_, rank) => {
    const coordinates = {};
    let rest = rank;
    for (let i = AXES.length - 1; i >= 0; i--) {
      coordinates[AXES[i]] = rest % shape[i];
      rest = Math.floor(rest / shape[i]);
    }
    return coordinates;
  });
}

function rankCell(rank, coordinates, state, step) {
  return h("div", {
    className: "xdit-rank",
    title: `rank ${rank}: ${AXES.map((axis) => `${axis}=${coordinates[axis]}`).join(" ")}`,
    dataset: { rank, state, ...coordinates },
    style: {
      background: STATE_COLOURS[state] ?? "#888", gridRow: coordinates.ring + 1, gridColumn: coordinates.ulysses + 1,
    },
  },
  h("span", { className: "xdit-rank-id" }, `r${rank}`),
  h("span", { className: "xdit-rank-step" }, step));
}

export class PoolPanel {
  /** `notify(text)` shows an error to the user (a toast). */
  constructor(notify) {
    this.notify = notify;
    this.pools = [];
    this.progress = new Map(); // endpoint → {step, total} of its current or last job
    this.pending = new Map(); // pool id → "stop" | "restart" while the request runs
    this.root = null;
    this.timer = null;
    this.fetchError = "";
    api.addEventListener("xdit.pool.step", ({ detail }) => this.onStep(detail));
    api.addEventListener("xdit.pool.update", ({ detail }) => this.setPools(detail?.pools));
    for (const event of ["execution_success", "execution_error", "execution_interrupted"]) {
      api.addEventListener(event, () => this.root && this.refresh()); // a job ended: show its pool idle now
    }
  }

  mount(el) {
    if (!document.getElementById("xdit-pool-css")) {
      document.head.append(h("style", { id: "xdit-pool-css", textContent: PANEL_CSS }));
    }
    if (this.root?.parentElement !== el) {
      this.root = h("div", { className: "xdit-panel" });
      el.replaceChildren(this.root);
    }
    this.draw();
    this.refresh();
    clearInterval(this.timer);
    this.timer = setInterval(() => this.refresh(), POLL_MS);
  }

  unmount() {
    clearInterval(this.timer);
    this.timer = null;
    this.root = null;
  }

  async refresh() {
    try {
      const response = await api.fetchApi("/xdit/pools", { cache: "no-store" });
      if (!response.ok) throw new Error(`GET /xdit/pools: HTTP ${response.status}`);
      this.fetchError = "";
      this.setPools((await response.json()).pools);
    } catch (error) {
      this.fetchError = String(error.message ?? error);
      this.draw();
    }
  }

  setPools(pools) {
    if (!Array.isArray(pools)) return;
    this.pools = pools;
    for (const pool of pools) {
      const known = this.progress.get(pool.endpoint);
      if (pool.status?.state === "busy" && pool.status.step && (!known || known.step !== pool.status.step)) {
        this.progress.set(pool.endpoint, { step: pool.status.step, total: known?.total });
      }
    }
    this.draw();
  }

  onStep({ endpoint, step, total } = {}) {
    this.progress.set(endpoint, { step, total });
    const pool = this.pools.find((p) => p.endpoint === endpoint);
    if (!pool || !this.root) return;
    pool.status = { ...pool.status, state: step < total ? "busy" : "idle", step };
    const card = this.root.querySelector(`.xdit-pool[data-pool-id="${CSS.escape(pool.id)}"]`);
    if (card) card.replaceWith(this.poolCard(pool));
  }

  async act(pool, action) {
    this.pending.set(pool.id, action);
    this.draw();
    try {
      const response = await api.fetchApi(`/xdit/pools/${encodeURIComponent(pool.id)}/${action}`, { method: "POST" });
      const body = await response.json();
      if (!response.ok) throw new Error(body.error ?? `HTTP ${response.status}`);
      this.pending.delete(pool.id);
      this.setPools(body.pools);
    } catch (error) {
      this.pending.delete(pool.id);
      this.notify(`${action} failed for ${pool.label}: ${error.message ?? error}`);
      this.draw();
    }
  }

  draw() {
    if (!this.root) return;
    const header = h("h3", {}, "xDiT pools", h("span", { className: "xdit-hint" }, `${this.pools.length} pool(s)`));
    const body = this.pools.length
      ? this.pools.map((pool) => this.poolCard(pool))
      : [h("div", { className: "xdit-empty xdit-hint" },
          "No pools yet. Queue a workflow with an xDiT Pool node; its ranks appear here.")];
    const error = this.fetchError ? h("div", { className: "xdit-fetch-error" }, this.fetchError) : "";
    this.root.replaceChildren(header, error, ...body);
  }

  poolCard(pool) {
    const status = pool.status ?? {};
    const state = status.state ?? "unreachable";
    const pending = this.pending.get(pool.id);
    const chips = [
      ["ranks", `${status.ranks_alive ?? "–"}/${status.world_size ?? pool.key?.nproc ?? "?"}`],
      ["jobs", status.jobs_done ?? 0],
      ["restarts", status.restarts ?? 0],
      ["queue", status.queue ?? 0],
    ];
    const storage = Object.keys(status.storage ?? {});  // the transformer's weight formats: fp8 / GGUF stay quantized
    if (storage.length) chips.push(["weights", storage.join(" + ")]);
    if (status.model_calls) chips.push(["model calls", status.model_calls]);  // xDiT Model: ComfyUI's samplers
    const cache = status.last_cache;
    if (cache) chips.push(["cache", `${cache.full} full / ${cache.cached} cached`]);
    return h("section", { className: "xdit-pool", dataset: { poolId: pool.id, state, endpoint: pool.endpoint } },
      h("div", { className: "xdit-pool-head" },
        h("span", { className: "xdit-pool-title", title: status.model ?? pool.key?.model ?? "" }, pool.label),
        h("span", { className: "xdit-state", style: { background: STATE_COLOURS[state] ?? "#888" } }, state)),
      h("div", { className: "xdit-hint xdit-pipeline" },
        `${status.pipeline ?? (state === "starting" ? "loading the model…" : "–")} · ${pool.endpoint}`,
        pool.managed ? "" : " (external)"),
      h("div", { className: "xdit-chips" }, chips.map(([name, value]) =>
        h("span", { className: "xdit-chip", dataset: { fact: name } }, h("b", {}, String(value)), ` ${name}`))),
      status.error ? h("div", { className: "xdit-pool-error" }, status.error) : null,
      this.meshView(pool, state),
      this.layoutAutoView(status.layout_auto),
      this.memoryView(status.memory),
      h("div", { className: "xdit-actions" },
        h("button", {
          className: "xdit-stop", disabled: !!pending || state === "stopped", onclick: () => this.act(pool, "stop"),
        },
          h("i", { className: "pi pi-stop-circle" }), pending === "stop" ? " Stopping…" : " Stop"),
        h("button", { className: "xdit-restart", disabled: !!pending, onclick: () => this.act(pool, "restart") },
          h("i", { className: "pi pi-refresh" }), pending === "restart" ? " Restarting…" : " Restart")));
  }

  /** One box per sp group (ranks sharing dp, cfg, pp), its ranks laid out as ring rows × ulysses columns. */
  meshView(pool, state) {
    const mesh = meshOf(pool);
    const degree = (axis) => Math.max(...mesh.map((c) => c[axis] ?? 0)) + 1;
    const [ring, ulysses] = [degree("ring"), degree("ulysses")];
    const outer = ["dp", "cfg", "pp"].filter((axis) => degree(axis) > 1);
    const groups = new Map(); // "dp,cfg,pp" → {coordinates, ranks}
    mesh.forEach((coordinates, rank) => {
      const key = [coordinates.dp, coordinates.cfg, coordinates.pp].join(",");
      if (!groups.has(key)) groups.set(key, { coordinates, ranks: [] });
      groups.get(key).ranks.push(rank);
    });
    const step = this.stepText(pool, state);
    const shape = `dp ${degree("dp")} × cfg ${degree("cfg")} × pp ${degree("pp")} × sp ${ring * ulysses}`
      + ` (ring ${ring} × ulysses ${ulysses})`;
    return h("div", { className: "xdit-mesh-wrap" },
      h("div", { className: "xdit-axes", title: "one box per sp group: ring rows × ulysses columns" }, shape),
      h("div", { className: "xdit-mesh" }, [...groups.values()].map(({ coordinates: { dp, cfg, pp }, ranks }) =>
        h("div", { className: "xdit-mesh-group", dataset: { dp, cfg, pp } },
          h("div", { className: "xdit-mesh-label" },
            outer.length ? outer.map((axis) => `${axis} ${({ dp, cfg, pp })[axis]}`).join(" · ") : "sp"),
          h("div", { className: "xdit-mesh-grid", style: { gridTemplateColumns: `repeat(${ulysses}, ${CELL_WIDTH})` } },
            ranks.map((rank) => rankCell(rank, mesh[rank], state, step)))))));
  }

  /** "7/20" while a job runs (and the last job's count after it); the state when there is no step to show. */
  stepText(pool, state) {
    const progress = this.progress.get(pool.endpoint);
    if (state !== "busy" && !(progress && state === "idle")) return state;
    return progress?.total ? `${progress.step}/${progress.total}` : `step ${pool.status?.step ?? progress?.step ?? 0}`;
  }

  /** --layout auto: the last job size's predicted step time per layout, fastest (the one running) first. */
  layoutAutoView(auto) {
    if (!auto) return null;
    const last = auto.last;
    const caption = last
      ? `layout auto (${auto.link} link, ${auto.choices.length} size(s) seen): ${last.job}`
      : `layout auto (${auto.link} link): ${auto.current} until the first job`;
    return h("table", { className: "xdit-layout-auto" },
      h("caption", {}, caption),
      last ? h("tr", {}, ["layout", "ms/step", "traffic"].map((title) => h("th", {}, title))) : null,
      (last?.predictions ?? []).map((row, index) => h("tr", {
        dataset: { layout: row.layout, chosen: index === 0 },
        title: `compute ${(row.compute_s * 1e3).toFixed(1)} ms, traffic ${(row.comm_s * 1e3).toFixed(1)} ms `
          + `(${(row.bytes_per_step / 2 ** 20).toFixed(2)} MiB) per step`,
      },
      h("td", {}, row.layout), h("td", {}, (row.step_s * 1e3).toFixed(1)), h("td", {}, (row.comm_s * 1e3).toFixed(1)))));
  }

  memoryView(memory) {
    if (!Array.isArray(memory) || !memory.length) return null;
    return h("table", { className: "xdit-memory" },
      h("caption", {}, "memory per rank (MB)"),
      h("tr", {}, ["rank", "RSS", "device", "params"].map((title) => h("th", {}, title))),
      memory.map((row) => h("tr", { dataset: { rank: row.rank } },
        h("td", {}, `r${row.rank}`), h("td", {}, megabytes(row.rss_bytes)),
        h("td", {}, megabytes(row.device_bytes)), h("td", {}, megabytes(row.parameter_bytes)))));
  }
}
