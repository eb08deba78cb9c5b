// Create, send (with an attribute), receive, delete and list through @aws-sdk/client-sqs against
// the SQS endpoint of a node (docs/SQS.md); prints one JSON object the Python test checks.
// Usage: SQS_JS_MODULES=<dir holding node_modules> node sqs_roundtrip.mjs <endpoint> <queue>
// Credentials and region come from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION.
import { createRequire } from "node:module";
import path from "node:path";

const require = createRequire(path.join(process.env.SQS_JS_MODULES || process.cwd(), "package.json"));
const {
  SQSClient, CreateQueueCommand, SendMessageCommand, ReceiveMessageCommand, DeleteMessageCommand,
  ListQueuesCommand, GetQueueUrlCommand,
} = require("@aws-sdk/client-sqs");

const [endpoint, queue] = process.argv.slice(2);
const sqs = new SQSClient({ endpoint, region: process.env.AWS_REGION || "us-east-1" });
const out = {};
const { QueueUrl } = await sqs.send(new CreateQueueCommand({ QueueName: queue }));
out.queueUrl = QueueUrl;
const sent = await sqs.send(new SendMessageCommand({
  QueueUrl, MessageBody: "from javascript ✓",
  MessageAttributes: { lang: { DataType: "String", StringValue: "js" } },
}));
out.messageId = sent.MessageId;
const got = await sqs.send(new ReceiveMessageCommand({
  QueueUrl, WaitTimeSeconds: 5, MaxNumberOfMessages: 10, MessageAttributeNames: ["All"],
}));
out.received = (got.Messages || []).map((m) => ({ id: m.MessageId, body: m.Body, lang: m.MessageAttributes?.lang?.StringValue }));
for (const m of got.Messages || []) {
  await sqs.send(new DeleteMessageCommand({ QueueUrl, ReceiptHandle: m.ReceiptHandle }));
}
out.listed = (await sqs.send(new ListQueuesCommand({ QueueNamePrefix: queue }))).QueueUrls || [];
try {
  await sqs.send(new GetQueueUrlCommand({ QueueName: "nowhere-js" }));
} catch (error) {
  out.missing = { name: error.name, code: error.Code || error.code || null };
}
console.log(JSON.stringify(out));
