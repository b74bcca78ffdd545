// Screenshots of a running TensorBoard, called by make.py: TB_URL, CHROMIUM, PROFILE, OUT.
import { chromium } from 'playwright-core';

const { TB_URL, CHROMIUM, PROFILE, OUT } = process.env;
const context = await chromium.launchPersistentContext(PROFILE, {
  executablePath: CHROMIUM,
  headless: true,
  args: [
    '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync',
  ],
  viewport: { width: 1400, height: 1080 },
});
const page = context.pages()[0] ?? (await context.newPage());

// (a) Custom Scalars: "gradient norm per layer" full width on a log y axis, the tooltip at a
// step listing the lines with their values.
await page.goto(`${TB_URL}/#custom_scalars`);
const card = page
  .locator('tf-custom-scalar-multi-line-chart-card')
  .filter({ hasText: 'gradient norm per layer' });
await card.waitFor();
await card.locator('paper-icon-button[icon="fullscreen"]').click();
await card.locator('paper-icon-button[icon="line-weight"]').click();
const chart = card.locator('vz-line-chart2');
await page.waitForTimeout(1000); // the resize and the log axis animate
const box = await chart.boundingBox();
await page.mouse.move(box.x + box.width * 0.55, box.y + box.height * 0.45);
await page.waitForTimeout(1000);
await page.screenshot({ path: `${OUT}/tensorboard-custom-scalars.png` });

// (b) Images: the heatmap of each run at its actual size.
await page.setViewportSize({ width: 1400, height: 1000 });
await page.goto(`${TB_URL}/#images`);
await page.getByText('Show actual image size').click();
await page.locator('img').last().waitFor();
await page.waitForTimeout(1000);
await page.screenshot({ path: `${OUT}/tensorboard-heatmap.png` });

await context.close();
