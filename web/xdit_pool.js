// xDiT Pool for ComfyUI: client-side degree validation of XDiTPool nodes, and the "xDiT" sidebar tab.
//
// The validation (the rules of the server's ParallelConfig.check) flags an XDiTPool node whose degrees do
// not multiply to nproc as soon as a widget changes, and refuses to queue while any such node exists, so
// the user sees the numbers and the fix before anything is sent. The tab shows the pool panel
// (xdit_pool_panel.js).
import { app } from "../../scripts/app.js";
import { PoolPanel } from "./xdit_pool_panel.js";

// -- validation ---------------------------------------------------------------------------------------

function widgetValue(node, name) {
  return node.widgets?.find((w) => w.name === name)?.value;
}

/** The problem with this XDiTPool node's layout, as one sentence with the numbers and the fix; "" if none. */
function layoutError(node) {
  if (String(widgetValue(node, "endpoint") ?? "").trim()) return ""; // the remote pool owns its layout
  if (widgetValue(node, "layout") === "auto") return ""; // the pool chooses the degrees per job size
  const nproc = Number(widgetValue(node, "nproc"));
  const degrees = {
    ulysses: Number(widgetValue(node, "ulysses_degree")),
    ring: Number(widgetValue(node, "ring_degree")),
    pipefusion: Number(widgetValue(node, "pipefusion_degree")),
    dp: Number(widgetValue(node, "dp_degree")),
    cfg: widgetValue(node, "cfg_parallel") ? 2 : 1,
  };
  const warmup = Number(widgetValue(node, "warmup_steps"));
  if (degrees.pipefusion > 1 && warmup < 1) {
    return `warmup_steps is ${warmup}; PipeFusion needs at least 1 synchronous step to fill its stale K/V, `
      + "so set warmup_steps to 1 or more.";
  }
  const product = Object.values(degrees).reduce((a, b) => a * b, 1);
  if (product === nproc) return "";
  const terms = Object.entries(degrees).map(([name, value]) => `${name} ${value}`).join(" × ");
  const others = product / degrees.ulysses;
  const fix = nproc % others === 0
    ? `set ulysses_degree to ${nproc / others}`
    : `change the degrees (or nproc) so they multiply to ${nproc}`;
  return `${terms} = ${product}, but nproc is ${nproc}; ${fix}.`;
}

function validate(node) {
  const error = layoutError(node);
  if (error !== node.xditError) node.setDirtyCanvas?.(true, true);
  node.xditError = error;
  return error;
}

function allNodes() {
  const graphs = [app.graph, ...(app.graph?.subgraphs?.values?.() ?? [])];
  return graphs.flatMap((graph) => graph?.nodes ?? graph?._nodes ?? []);
}

const SKIPPED_MODES = new Set([2, 4]); // muted or bypassed: not part of the prompt

function invalidPools() {
  return allNodes().filter((node) => node.comfyClass === "XDiTPool" && !SKIPPED_MODES.has(node.mode) && validate(node));
}

function notify(detail) {
  const toast = app.extensionManager?.toast;
  if (toast?.add) toast.add({ severity: "error", summary: "xDiT Pool", detail, life: 5000 });
  else alert(`xDiT Pool: ${detail}`);
}

function patchPoolNode(nodeType) {
  const proto = nodeType.prototype;
  const chain = (name, after) => {
    const original = proto[name];
    proto[name] = function (...args) {
      const result = original?.apply(this, args);
      after.apply(this, args);
      return result;
    };
  };
  chain("onNodeCreated", function () {
    this.strokeStyles ??= {};
    this.strokeStyles.xditLayout = function () {
      return this.xditError ? { color: "#ff4d4f", lineWidth: 3 } : undefined;
    };
    for (const widget of this.widgets ?? []) {
      const callback = widget.callback;
      widget.callback = (...args) => {
        const result = callback?.apply(widget, args);
        validate(this);
        return result;
      };
    }
    validate(this);
  });
  chain("onConfigure", function () { validate(this); });
  chain("onWidgetChanged", function () { validate(this); });
  chain("onDrawForeground", function (ctx) {
    if (this.xditError && !this.flags?.collapsed) drawWarning(ctx, this.xditError, this.size[0], this.size[1] + 6);
  });
}

/** The layout error in a red box under the node, wrapped to the node's width. */
function drawWarning(ctx, message, width, top) {
  const [padding, lineHeight] = [6, 15];
  ctx.save();
  ctx.font = "12px sans-serif";
  const lines = [];
  for (const word of `⚠ ${message}`.split(" ")) {
    const line = lines.length ? `${lines[lines.length - 1]} ${word}` : word;
    if (lines.length && ctx.measureText(line).width <= width - 2 * padding) lines[lines.length - 1] = line;
    else lines.push(word);
  }
  ctx.fillStyle = "rgba(120, 20, 24, 0.92)";
  ctx.strokeStyle = "#ff4d4f";
  ctx.beginPath();
  ctx.roundRect(0, top, width, lines.length * lineHeight + 2 * padding, 6);
  ctx.fill();
  ctx.stroke();
  ctx.fillStyle = "#fff";
  ctx.textBaseline = "top";
  lines.forEach((line, i) => ctx.fillText(line, padding, top + padding + i * lineHeight));
  ctx.restore();
}

function guardQueue() {
  const queuePrompt = app.queuePrompt.bind(app);
  app.queuePrompt = async function (...args) {
    const invalid = invalidPools();
    if (invalid.length) {
      const which = invalid.map((node) => `#${node.id}: ${node.xditError}`).join(" ");
      notify(`Not queued: an xDiT Pool layout does not fit its ranks. ${which}`);
      app.canvas?.setDirty?.(true, true);
      return false;
    }
    return queuePrompt(...args);
  };
}

// -- registration --------------------------------------------------------------------------------------

app.registerExtension({
  name: "xdit.pool",
  async setup() {
    guardQueue();
    const panel = new PoolPanel(notify);
    app.extensionManager.registerSidebarTab({
      id: "xdit-pools",
      icon: "pi pi-sitemap",
      title: "xDiT",
      tooltip: "xDiT pools: ranks, mesh, live steps",
      type: "custom",
      render: (el) => panel.mount(el),
      destroy: () => panel.unmount(),
    });
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name === "XDiTPool") patchPoolNode(nodeType);
  },
});
