// xDiT Pool for ComfyUI: degree validation of XDiTPool nodes by the server's own check, and the "xDiT" sidebar tab.
//
// Whenever a widget of an XDiTPool node changes, its values go to POST /xdit/layout/check, which answers with
// the pool's own ParallelConfig.check (one sentence with the numbers and the fix, or ""). A node whose layout does
// not fit its nproc is flagged, and queueing is refused while any such node exists, so the user sees the numbers
// and the fix before anything runs. The tab shows the pool panel (xdit_pool_panel.js).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { PoolPanel } from "./xdit_pool_panel.js";

// -- validation ---------------------------------------------------------------------------------------

/** The server's verdict on this XDiTPool node's layout: "" when it fits. */
async function layoutError(node) {
  const values = Object.fromEntries((node.widgets ?? []).map((widget) => [widget.name, widget.value]));
  const response = await api.fetchApi("/xdit/layout/check", { method: "POST", body: JSON.stringify(values) });
  return (await response.json()).error ?? "";
}

/** Ask the server about `node` and flag it; only the answer to the newest question counts. The node keeps the
 * pending answer as `xditCheck`, so whoever reads `xditError` can wait for it. */
function validate(node) {
  const asked = (node.xditAsked = (node.xditAsked ?? 0) + 1);
  node.xditCheck = layoutError(node).then((error) => {
    if (asked === node.xditAsked) {
      if (error !== node.xditError) node.setDirtyCanvas?.(true, true);
      node.xditError = error;
    }
    return node.xditError;
  });
  return node.xditCheck;
}

function allNodes() {
  const graphs = [app.graph, ...(app.graph?.subgraphs?.values?.() ?? [])];
  return graphs.flatMap((graph) => graph?.nodes ?? graph?._nodes ?? []);
}

const SKIPPED_MODES = new Set([2, 4]); // muted or bypassed: not part of the prompt

async function invalidPools() {
  const pools = allNodes().filter((node) => node.comfyClass === "XDiTPool" && !SKIPPED_MODES.has(node.mode));
  const errors = await Promise.all(pools.map(validate));
  return pools.filter((node, index) => errors[index]);
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
    const invalid = await invalidPools();
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
