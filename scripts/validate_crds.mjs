// Validate custom resources against their CRD schemas: node scripts/validate_crds.mjs [SCHEMAS] < objects.json
// objects.json: a JSON array of Kubernetes objects. SCHEMAS: where scripts/install_crd_schemas.sh put the packages
// (default .venv/crd-schemas). Prints one line per object refused and exits 1 if any was; exits 2 on a kind it has
// no schema for.
import { readFileSync } from "node:fs";
import { resolve } from "node:path";
import { pathToFileURL } from "node:url";

const MODELS = {
  "monitoring.coreos.com/v1": ["@kubernetes-models/prometheus-operator", ["ServiceMonitor", "PodMonitor", "PrometheusRule"]],
  "cert-manager.io/v1": ["@kubernetes-models/cert-manager", ["Certificate"]],
  "gateway.networking.k8s.io/v1": ["@kubernetes-models/gateway-api", ["GRPCRoute", "HTTPRoute"]],
};
const schemas = resolve(process.argv[2] ?? ".venv/crd-schemas", "node_modules");
const objects = JSON.parse(readFileSync(0, "utf8"));
let refused = 0;
for (const object of objects) {
  const [pkg, kinds] = MODELS[object.apiVersion] ?? [null, []];
  const where = `${object.kind} ${object.metadata?.name}`;
  if (!kinds.includes(object.kind)) {
    console.log(`${where}: no schema for ${object.apiVersion} ${object.kind}`);
    process.exit(2);
  }
  const group = object.apiVersion.split("/")[0];
  const url = pathToFileURL(resolve(schemas, pkg, group, object.apiVersion.split("/")[1], `${object.kind}.js`));
  const model = (await import(url.href))[object.kind];
  try {
    new model(object).validate();
  } catch (error) {
    console.log(`${where}: ${error.message}`);
    refused += 1;
  }
}
console.log(`validate_crds: ${objects.length - refused} of ${objects.length} objects valid`);
process.exit(refused ? 1 : 0);
