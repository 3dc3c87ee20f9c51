// Reads a JSON list of Kubernetes objects on stdin; prints, for each, null when it validates
// against its kind's schema, the validator's message when it does not, or "unknown kind".
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";

const MODELS = {
  "keda.sh/v1alpha1/ScaledObject": ScaledObject,
  "monitoring.coreos.com/v1/ServiceMonitor": ServiceMonitor,
};

let input = "";
for await (const chunk of process.stdin) input += chunk;
const results = JSON.parse(input).map((object) => {
  const Model = MODELS[`${object.apiVersion}/${object.kind}`];
  if (!Model) return "unknown kind";
  try {
    new Model(object).validate();
    return null;
  } catch (error) {
    return error.message;
  }
});
process.stdout.write(JSON.stringify(results));
