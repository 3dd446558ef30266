// A headless Chromium page on ComfyUI's frontend, driven over stdin/stdout one JSON line at a time.
//
// Usage: NODE_PATH=<dir holding playwright-core> node driver.js URL [CHROMIUM]
// Prints {"ready": true} once `window.app` exists, then answers each request line
//   {"cmd": "eval", "js": "async (arg) => ...", "arg": ...}       → {"ok": true, "value": ...}
//   {"cmd": "wait", "js": "(arg) => predicate", "arg": ..., "timeout": ms}
//   {"cmd": "click", "selector": "..."}
//   {"cmd": "screenshot", "path": "...", "selector": optional}
//   {"cmd": "requests"}  → the POST /prompt requests made so far ("reset": true clears them)
//   {"cmd": "errors"}    → page errors and console errors so far
// with {"ok": false, "error": "..."} on failure. The tests keep their logic in Python; this file only
// gives them a page.
const { chromium } = require("playwright-core");
const readline = require("readline");

const [url, executablePath = "/usr/bin/chromium"] = process.argv.slice(2);
const ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync"];

async function main() {
  const browser = await chromium.launch({ executablePath, headless: true, args: ARGS });
  const page = await browser.newPage({ viewport: { width: 1500, height: 950 } });
  const errors = [];
  let prompts = [];
  page.on("pageerror", (error) => errors.push(String(error?.stack ?? error)));
  page.on("response", (response) => {
    if (response.status() >= 400) errors.push(`HTTP ${response.status()} ${response.url()}`);
  });
  page.on("console", (message) => { if (message.type() === "error") errors.push(`console: ${message.text()}`); });
  page.on("request", (request) => {
    const isPrompt = request.method() === "POST" && /\/prompt$/.test(new URL(request.url()).pathname);
    if (isPrompt) prompts.push(request.postData());
  });
  await page.goto(url, { waitUntil: "load", timeout: 60000 });
  await page.waitForFunction(() => window.app?.graph && window.app.extensionManager, null, { timeout: 60000 });

  const commands = {
    eval: ({ js, arg }) => page.evaluate(([source, value]) => (0, eval)(`(${source})`)(value), [js, arg]),
    wait: async ({ js, arg, timeout = 30000 }) => { // polls, so the predicate may be async
      const deadline = Date.now() + timeout;
      for (;;) {
        const value = await commands.eval({ js, arg });
        if (value) return value;
        if (Date.now() > deadline) throw new Error(`timed out after ${timeout} ms waiting for ${js}`);
        await new Promise((resolve) => setTimeout(resolve, 100));
      }
    },
    click: async ({ selector }) => { await page.click(selector, { timeout: 10000 }); return true; },
    screenshot: async ({ path, selector }) => {
      await (selector ? page.locator(selector).first() : page).screenshot({ path });
      return path;
    },
    requests: ({ reset }) => { const made = prompts; if (reset) prompts = []; return made; },
    errors: () => errors,
  };

  console.log(JSON.stringify({ ready: true }));
  const lines = readline.createInterface({ input: process.stdin });
  for await (const line of lines) {
    if (!line.trim()) continue;
    let reply;
    try {
      const request = JSON.parse(line);
      const command = commands[request.cmd];
      if (!command) throw new Error(`unknown command ${request.cmd}`);
      reply = { ok: true, value: (await command(request)) ?? null };
    } catch (error) {
      reply = { ok: false, error: String(error?.stack ?? error) };
    }
    console.log(JSON.stringify(reply));
  }
  await browser.close();
}

main().catch((error) => {
  console.log(JSON.stringify({ ready: false, error: String(error?.stack ?? error) }));
  process.exit(1);
});
