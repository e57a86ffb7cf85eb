// k8s_validate.mjs: render every Kustomize target under deploy/k8s with the
// pinned kustomize, validate every rendered object against the Kubernetes API
// schemas (kubernetes-models: JSON schemas generated from the Kubernetes
// OpenAPI spec, checked with ajv; the ServiceMonitor against the
// prometheus-operator CRD schema), then check the project's own deployment
// rules that no schema can know (probes, drain, GPUs = TP, NVLS off, selectors
// that really select, HPA metrics that the adapter really serves).
//
// usage: node k8s_validate.mjs KUSTOMIZE_BIN DEPLOY_K8S_DIR [SRC_DIR]
// With SRC_DIR, every container's command-line flags are checked against the
// options the program really parses (the rows of its common/base/opts.h table,
// TW_OPT_*("name", ...), in router/,
// prefill/ or decode/, and common/worker/worker_daemon.h's TW_WORKER_OPTS for the
// workers), "--flag value" form, as the daemons expect.
// Exit 0 when everything passes; 1 with one line per problem otherwise.
import { execFileSync } from "node:child_process";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { parseAllDocuments, parse as parseYaml } from "yaml";

const [kustomize, root, srcDir] = process.argv.slice(2);
if (!kustomize || !root) {
  console.error("usage: node k8s_validate.mjs KUSTOMIZE_BIN DEPLOY_K8S_DIR");
  process.exit(2);
}

const problems = [];
const fail = (where, msg) => problems.push(`${where}: ${msg}`);

// ---- schema validation ------------------------------------------------------
const modelCache = new Map();
async function modelFor(apiVersion, kind) {
  const key = `${apiVersion}/${kind}`;
  if (modelCache.has(key)) return modelCache.get(key);
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  const candidates = [];
  if (group === "monitoring.coreos.com")
    candidates.push(`@kubernetes-models/prometheus-operator/${group}/${version}/${kind}`);
  else candidates.push(group ? `kubernetes-models/${group}/${version}/${kind}` : `kubernetes-models/${version}/${kind}`);
  let cls = null;
  for (const c of candidates) {
    try {
      const mod = await import(c);
      if (mod[kind]) { cls = mod[kind]; break; }
    } catch { /* not that one */ }
  }
  modelCache.set(key, cls);
  return cls;
}

async function validateSchema(where, obj) {
  if (!obj || typeof obj !== "object" || !obj.apiVersion || !obj.kind) {
    fail(where, "document without apiVersion/kind");
    return false;
  }
  const cls = await modelFor(obj.apiVersion, obj.kind);
  if (!cls) {
    fail(where, `no schema for ${obj.apiVersion} ${obj.kind} (unknown kind or API version)`);
    return false;
  }
  try {
    new cls(structuredClone(obj)).validate();
    return true;
  } catch (e) {
    fail(where, `schema: ${String(e.message || e).split("\n").join("; ")}`);
    return false;
  }
}

function render(dir) {
  return execFileSync(kustomize, ["build", dir], { encoding: "utf8", timeout: 60000, stdio: ["ignore", "pipe", "pipe"] });
}

function parseDocs(where, text) {
  const out = [];
  for (const d of parseAllDocuments(text)) {
    if (d.errors.length) fail(where, `YAML: ${d.errors[0].message}`);
    const o = d.toJS();
    if (o !== null && o !== undefined) out.push(o);
  }
  return out;
}

// ---- the programs' real options ---------------------------------------------
const programFolder = { "twain-router": "router", "twain-prefill": "prefill", "twain-decode": "decode" };
const flagCache = new Map();
function knownFlags(prog) {
  if (!srcDir || !programFolder[prog]) return null;
  if (!flagCache.has(prog)) {
    const dir = join(srcDir, programFolder[prog]);
    const flags = new Set(["--config"]); /* every daemon's, from the parser itself */
    const scan = (text) => {
      for (const m of text.matchAll(/TW_OPT_[A-Z_]+\(\s*"([a-z][a-z0-9-]*)"/g)) flags.add("--" + m[1]);
    };
    for (const f of readdirSync(dir)) {
      if (!f.endsWith(".c") && !f.endsWith(".h")) continue;
      const text = readFileSync(join(dir, f), "utf8");
      scan(text);
      /* the options every worker daemon takes (common/worker/worker_daemon.h) */
      if (/TW_WORKER_OPTS\(/.test(text)) scan(readFileSync(join(srcDir, "common", "worker", "worker_daemon.h"), "utf8"));
    }
    flagCache.set(prog, flags);
  }
  return flagCache.get(prog);
}
function checkArgs(where, c) {
  const prog = (c.command || [])[0];
  const flags = knownFlags(prog);
  if (srcDir && !flags) { fail(where, `command ${prog} is not one of ${Object.keys(programFolder).join(", ")}`); return; }
  if (!flags) return;
  const args = c.args || [];
  for (let i = 0; i < args.length; i++) {
    const a = String(args[i]);
    if (!a.startsWith("--")) { fail(where, `argument ${i} '${a}' is not a --flag (values follow their flag)`); continue; }
    if (a.includes("=")) { /* --flag=value: one argument */
      if (!flags.has(a.slice(0, a.indexOf("=")))) fail(where, `${prog} has no option ${a.slice(0, a.indexOf("="))}`);
      continue;
    }
    if (!flags.has(a)) fail(where, `${prog} has no option ${a}`);
    if (i + 1 >= args.length || String(args[i + 1]).startsWith("--")) fail(where, `${a} has no value`);
    i++;
  }
}

// ---- project rules ----------------------------------------------------------
const nameOf = (o) => `${o.kind}/${o.metadata?.name}`;
const matches = (sel, labels) => sel && Object.keys(sel).length > 0 &&
  Object.entries(sel).every(([k, v]) => labels?.[k] === v);
const envValue = (c, n) => (c.env || []).find((e) => e.name === n)?.value;

function checkPodTemplate(where, dep, isWorker) {
  const spec = dep.spec?.template?.spec || {};
  const labels = dep.spec?.template?.metadata?.labels;
  if (!matches(dep.spec?.selector?.matchLabels, labels)) fail(where, "selector does not match the pod template labels");
  if (!spec.securityContext?.runAsNonRoot) fail(where, "pods must run as non-root");
  const grace = spec.terminationGracePeriodSeconds ?? 30;
  if (grace < 300) fail(where, `terminationGracePeriodSeconds ${grace} < 300: too short to finish streams`);
  const volumes = new Set((spec.volumes || []).map((v) => v.name));
  for (const c of spec.containers || []) {
    const cw = `${where} container ${c.name}`;
    checkArgs(cw, c);
    const portNames = new Set((c.ports || []).map((p) => p.name));
    // Readiness (and startup) on /healthz, which turns 503 while draining;
    // liveness on /livez, which stays 200 while the process drains (the
    // kubelet probes liveness during termination too).
    for (const [probe, path, required] of [["readinessProbe", "/healthz", true], ["startupProbe", "/healthz", false],
                                           ["livenessProbe", "/livez", true]]) {
      const p = c[probe];
      if (!p) { if (required) fail(cw, `${probe} missing`); continue; }
      if (!p.httpGet || p.httpGet.path !== path) fail(cw, `${probe} must be httpGet ${path}`);
      else if (typeof p.httpGet.port === "string" && !portNames.has(p.httpGet.port)) fail(cw, `${probe} port ${p.httpGet.port} is not a container port`);
    }
    // the metrics server must listen beyond the pod's loopback for probes and scraping
    const args = (c.args || []).map(String);
    const argOf = (f) => { const i = args.indexOf(f); return i >= 0 ? args[i + 1] : undefined; };
    if (argOf("--metrics-addr") !== "0.0.0.0") fail(cw, "--metrics-addr 0.0.0.0 missing (the daemons bind 127.0.0.1 by default)");
    // router and decode drains are bounded by --drain-timeout: below the grace period
    if (!isWorker || c.name === "decode") {
      const dt = Number(argOf("--drain-timeout"));
      if (!(dt > 0)) fail(cw, "--drain-timeout SECONDS missing (router and decode)");
      else if (dt >= grace) fail(cw, `--drain-timeout ${dt} >= terminationGracePeriodSeconds ${grace}`);
    }
    const pre = c.lifecycle?.preStop?.exec?.command?.join(" ") || "";
    if (!/kill -TERM 1/.test(pre)) fail(cw, "preStop must start the drain (SIGTERM to the daemon) and wait for it");
    if (envValue(c, "NCCL_NVLS_ENABLE") !== "0") fail(cw, "NCCL_NVLS_ENABLE=0 missing");
    // internal links: CURVE keys from a Secret, never plaintext (common/comm/link_auth.h)
    const keys = (c.env || []).find((e) => e.name === "TWAIN_KEYS");
    if (!keys?.valueFrom?.secretKeyRef?.name || !keys.valueFrom.secretKeyRef.key)
      fail(cw, "TWAIN_KEYS must come from a Secret (secretKeyRef): the link keys");
    if ((c.env || []).some((e) => e.name === "TWAIN_INSECURE_PLAINTEXT")) fail(cw, "TWAIN_INSECURE_PLAINTEXT set: links unencrypted");
    const declared = new Set((c.env || []).map((e) => e.name));
    for (const a of [...(c.command || []), ...(c.args || [])]) {
      for (const m of String(a).matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g))
        if (!declared.has(m[1])) fail(cw, `argument uses $(${m[1]}) but no env ${m[1]} is declared`);
    }
    for (const vm of c.volumeMounts || []) if (!volumes.has(vm.name)) fail(cw, `volumeMount ${vm.name} has no volume`);
    const model = envValue(c, "TWAIN_MODEL");
    if (!model || !model.startsWith("/models/") || model.includes("set-by-overlay")) fail(cw, `TWAIN_MODEL ${model} is not a model directory on the model volume`);
    if (isWorker) {
      const req = c.resources?.requests?.["nvidia.com/gpu"], lim = c.resources?.limits?.["nvidia.com/gpu"];
      const tp = envValue(c, "TWAIN_TP"), ep = envValue(c, "TWAIN_EP");
      if (String(req) !== String(lim)) fail(cw, `nvidia.com/gpu request ${req} != limit ${lim}`);
      if (String(lim) !== String(tp)) fail(cw, `nvidia.com/gpu ${lim} != TWAIN_TP ${tp}: one pod holds all the worker's ranks, one GPU each`);
      if (!["1", "2", "4", "8"].includes(String(tp))) fail(cw, `TWAIN_TP ${tp} not one of 1, 2, 4, 8`);
      if (!["1", "2", "4", "8"].includes(String(ep)) || Number(ep) > Number(tp)) fail(cw, `TWAIN_EP ${ep} must be 1, 2, 4 or 8 and at most TP`);
      if (!envValue(c, "TWAIN_ROUTER")?.startsWith("tcp://")) fail(cw, "TWAIN_ROUTER must be a tcp:// endpoint");
    }
  }
}

function checkTarget(target, objs, adapterMetrics) {
  const byKind = (k) => objs.filter((o) => o.kind === k);
  const deps = byKind("Deployment");
  const ns = objs.find((o) => o.kind === "Namespace")?.metadata?.name;
  if (ns) for (const o of objs) if (o.kind !== "Namespace" && o.metadata?.namespace !== ns) fail(`${target} ${nameOf(o)}`, `namespace ${o.metadata?.namespace}, expected ${ns}`);
  const pools = ["twain-router", "twain-prefill", "twain-decode"];
  for (const p of pools) if (!deps.find((d) => d.metadata.name === p)) fail(target, `Deployment ${p} missing`);
  for (const d of deps) checkPodTemplate(`${target} ${nameOf(d)}`, d, d.metadata.name !== "twain-router");
  const podLabels = deps.map((d) => d.spec?.template?.metadata?.labels || {});
  const claims = new Set(byKind("PersistentVolumeClaim").map((p) => p.metadata.name));
  for (const d of deps) for (const v of d.spec?.template?.spec?.volumes || [])
    if (v.persistentVolumeClaim && !claims.has(v.persistentVolumeClaim.claimName)) fail(`${target} ${nameOf(d)}`, `claim ${v.persistentVolumeClaim.claimName} is not rendered`);
  for (const s of byKind("Service")) {
    const sel = deps.filter((d) => matches(s.spec?.selector, d.spec?.template?.metadata?.labels));
    if (sel.length !== 1) { fail(`${target} ${nameOf(s)}`, `selector matches ${sel.length} Deployments, expected 1`); continue; }
    const ports = new Set(sel[0].spec.template.spec.containers.flatMap((c) => (c.ports || []).map((p) => p.name)));
    for (const p of s.spec.ports || []) if (typeof p.targetPort === "string" && !ports.has(p.targetPort)) fail(`${target} ${nameOf(s)}`, `targetPort ${p.targetPort} is not a container port`);
  }
  for (const p of byKind("PodDisruptionBudget")) {
    const n = podLabels.filter((l) => matches(p.spec?.selector?.matchLabels, l)).length;
    if (n !== 1) fail(`${target} ${nameOf(p)}`, `selector matches ${n} pod templates, expected 1`);
  }
  const hpas = byKind("HorizontalPodAutoscaler");
  for (const pool of ["twain-prefill", "twain-decode"]) {
    const h = hpas.find((x) => x.spec?.scaleTargetRef?.name === pool);
    if (!h) { fail(target, `no HorizontalPodAutoscaler scales ${pool}`); continue; }
    if (h.spec.scaleTargetRef.kind !== "Deployment") fail(`${target} ${nameOf(h)}`, "must scale a Deployment");
    for (const m of h.spec.metrics || []) {
      if (m.type !== "Pods") { fail(`${target} ${nameOf(h)}`, `metric type ${m.type}: expected the pool's own Pods metric`); continue; }
      const want = pool === "twain-prefill" ? "twain_prefill_queued_prompt_tokens" : "twain_decode_kv_utilization";
      if (m.pods.metric.name !== want) fail(`${target} ${nameOf(h)}`, `metric ${m.pods.metric.name}, expected ${want}`);
      if (!adapterMetrics.has(m.pods.metric.name)) fail(`${target} ${nameOf(h)}`, `the Prometheus adapter rules do not serve ${m.pods.metric.name}`);
    }
  }
  const sms = byKind("ServiceMonitor");
  if (sms.length !== 1) fail(target, `expected one ServiceMonitor, found ${sms.length}`);
  for (const sm of sms) {
    const svcs = byKind("Service").filter((s) => matches(sm.spec.selector.matchLabels, s.metadata.labels));
    const scraped = svcs.filter((s) => (s.spec.ports || []).some((p) => sm.spec.endpoints.some((e) => e.port === p.name)));
    for (const p of pools) if (!scraped.find((s) => s.spec.selector?.["app.kubernetes.io/name"] === p)) fail(`${target} ${nameOf(sm)}`, `does not scrape ${p}`);
  }
}

// ---- main -------------------------------------------------------------------
let nObjects = 0;
const targets = [];
for (const d of readdirSync(join(root, "overlays"))) {
  if (existsSync(join(root, "overlays", d, "kustomization.yaml"))) targets.push(join("overlays", d));
}
if (targets.length < 2) fail(root, `expected the gpt-oss-20b and gpt-oss-120b overlays, found ${targets.join(", ")}`);

// The adapter rules are rendered and validated too, and tell which metrics exist.
const adapterMetrics = new Set();
{
  const objs = parseDocs("prometheus-adapter", render(join(root, "prometheus-adapter")));
  for (const o of objs) { nObjects++; await validateSchema(`prometheus-adapter ${nameOf(o)}`, o); }
  const cm = objs.find((o) => o.kind === "ConfigMap");
  const rules = cm ? parseYaml(cm.data["config.yaml"]).rules : [];
  for (const r of rules || []) if (r.name?.as) adapterMetrics.add(r.name.as);
  if (!adapterMetrics.size) fail("prometheus-adapter", "no rules with name.as");
}
// The Grafana dashboard's ConfigMap (grafana/): valid, loadable by the
// sidecar, and the JSON a dashboard with panels that query twain metrics.
{
  const objs = parseDocs("grafana", render(join(root, "grafana")));
  for (const o of objs) { nObjects++; await validateSchema(`grafana ${nameOf(o)}`, o); }
  const cm = objs.find((o) => o.kind === "ConfigMap");
  if (!cm || cm.metadata?.labels?.grafana_dashboard !== "1") fail("grafana", "no ConfigMap labelled grafana_dashboard: \"1\"");
  let dash = null;
  try { dash = JSON.parse(cm?.data?.["twain-dashboard.json"] ?? ""); } catch (e) { fail("grafana", `dashboard JSON: ${e.message}`); }
  const exprs = (dash?.panels || []).flatMap((p) => (p.targets || []).map((t) => t.expr || ""));
  if (exprs.length < 8 || !exprs.every((e) => /twain_[a-z_]+/.test(e))) fail("grafana", `${exprs.length} panel queries, each must read a twain_ metric`);
  else console.log(`rendered grafana: dashboard "${dash.title}", ${dash.panels.length} panels, ${exprs.length} queries`);
}
for (const t of targets) {
  let text;
  try { text = render(join(root, t)); } catch (e) { fail(t, `kustomize build failed: ${e.stderr || e.message}`); continue; }
  const objs = parseDocs(t, text);
  for (const o of objs) { nObjects++; await validateSchema(`${t} ${nameOf(o)}`, o); }
  checkTarget(t, objs, adapterMetrics);
  console.log(`rendered ${t}: ${objs.length} objects (${[...new Set(objs.map((o) => o.kind))].join(", ")})`);
}

// Self-test: the validator must reject a broken object, or it proves nothing.
{
  const before = problems.length;
  const bad = { apiVersion: "apps/v1", kind: "Deployment", metadata: { name: "x" },
    spec: { template: { spec: { containers: [{ name: "c", image: "i", ports: [{ containerPort: "9100" }] }] } } } };
  await validateSchema("self-test", bad);
  await validateSchema("self-test", { apiVersion: "autoscaling/v2", kind: "HorizontalPodAutoscaler", metadata: { name: "x" }, spec: { maxReplicas: "many" } });
  await validateSchema("self-test", { apiVersion: "monitoring.coreos.com/v1", kind: "ServiceMonitor", metadata: { name: "x" }, spec: { selector: {}, endpoints: [{ interval: "15 seconds" }] } });
  await validateSchema("self-test", { apiVersion: "example.com/v9", kind: "Nonsense", metadata: { name: "x" } });
  const caught = problems.length - before;
  problems.splice(before);
  if (caught !== 4) fail("self-test", `the validator rejected ${caught} of 4 broken objects`);
  else console.log("self-test: the validator rejects 4 of 4 broken objects");
}

if (problems.length) {
  for (const p of problems) console.error(`FAIL ${p}`);
  console.error(`k8s_validate: ${problems.length} problem(s) in ${nObjects} objects`);
  process.exit(1);
}
console.log(`k8s_validate: ${nObjects} objects in ${targets.length} overlays + prometheus-adapter valid`);
