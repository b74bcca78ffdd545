// Screenshots of a running TensorBoard, called by make.py: TB_URL, CHROMIUM, PROFILE, OUT.
// Each page is shot as a user first sees it: no chart expanded, no axis switched.
import { chromium } from 'playwright-core';

const { TB_URL, CHROMIUM, PROFILE, OUT } = process.env;
const context = await chromium.launchPersistentContext(PROFILE, {
  executablePath: CHROMIUM,
  headless: true,
  args: [
    '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync',
  ],
  viewport: { width: 1400, height: 1000 },
  deviceScaleFactor: 2, // the small default charts stay legible in the README
});
const page = context.pages()[0] ?? (await context.newPage());

// Show only the runs whose names match ``regex`` (the sidebar's run filter).
async function onlyRuns(regex) {
  await page.getByLabel('Write a regex to filter runs').filter({ visible: true }).fill(regex);
  await page.waitForTimeout(1000);
}

// The page down to the sidebar's runs (their colours) or ``bottom``, whichever is lower.
async function shootTop(name, bottom) {
  const runs = await page.getByText('Toggle all runs').last().boundingBox();
  const box = await bottom.boundingBox();
  const height = Math.max(runs.y + runs.height, box.y + box.height) + 16;
  await page.screenshot({
    path: `${OUT}/${name}`,
    clip: { x: 0, y: 0, width: 1400, height: Math.min(1000, height) },
  });
}

// (a) Custom Scalars: the per-layer charts, log10 and raw, at their default size; the runs of
// 4 and 12 blocks.
await page.goto(`${TB_URL}/#custom_scalars`);
await onlyRuns('blocks');
const raw = page
  .locator('tf-custom-scalar-multi-line-chart-card')
  .filter({ hasText: /^\s*gradient norm per layer\s/ });
await raw.waitFor();
await page.waitForTimeout(2000); // the lines load and draw
await shootTop('tensorboard-custom-scalars.png', raw);

// (b) Images: the heatmap of each of those runs at its actual size.
await page.goto(`${TB_URL}/#images`);
await onlyRuns('blocks');
await page.getByText('Show actual image size').click();
await page.locator('img').last().waitFor();
await page.waitForTimeout(1000);
await page.screenshot({ path: `${OUT}/tensorboard-heatmap.png` });

// (c) Text: the findings of the nan run, every episode one line.
await page.goto(`${TB_URL}/#text`);
await onlyRuns('nan');
const table = page.locator('tf-text-loader').filter({ hasText: 'nonfinite_loss' });
await table.waitFor();
await page.waitForTimeout(1000);
await shootTop('tensorboard-findings.png', table);

await context.close();
