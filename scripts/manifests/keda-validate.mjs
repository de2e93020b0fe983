// Validates KEDA ScaledObjects with the JSON-schema validators of the npm package
// @kubernetes-models/keda (generated from KEDA's Go API types, keda.sh/v1alpha1), for
// scripts/check-manifests. Usage: node keda-validate.mjs NODE_MODULES_DIR < objects.json
// Input: a JSON array of ScaledObjects. Output: a JSON array, per object null (valid) or the
// validator's message. Exit status 0 unless the validator could not be loaded.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const modules = process.argv[2];
if (!modules) {
  console.error("usage: node keda-validate.mjs NODE_MODULES_DIR < objects.json");
  process.exit(2);
}
const entry = join(modules, "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject.js");
const { ScaledObject } = await import(pathToFileURL(entry).href);
const objects = JSON.parse(readFileSync(0, "utf8"));
const answers = objects.map((object) => {
  try {
    new ScaledObject(object).validate();
    return null;
  } catch (error) {
    return String(error.message || error);
  }
});
process.stdout.write(JSON.stringify(answers));
